"""PyTorch's own, in closed form: FSDP2's (as ZeRO-3 and as ZeRO-2), ZeroRedundancyOptimizer's and DTensor
tensor parallelism's traffic per step.

Each is what torch's implementation sends, counted from its plan (not from the hand-written
strategies' counts); like every theory file, independent of the code and the log it checks.
"""

from __future__ import annotations

from fractions import Fraction

from parallel.algebra import (
    all_ranks,
    all_reduce_sent_per_rank,
    figure,
    gather_or_scatter_sent_per_rank,
    padded,
    parameter_count,
    tp_shard_parameter_count,
)
from parallel.core.model import GPTConfig
from parallel.layout import Layout
from parallel.zero.hsdp_theory import hybrid_figure


def fsdp2_group_padded_counts(model: GPTConfig, n: int) -> dict[str, int]:
    """Elements FSDP2 all-gathers and reduce-scatters per parameter group (torch 2.13,
    _fully_shard/_fsdp_param.py): every parameter is cut along dim 0 into n chunks of ceil(d0/n)
    rows, each padded to that size, so a parameter of shape (d0, ...) moves n·ceil(d0/n)·(rest)
    elements. Groups: each Block, and the root (embedding and head). An MoE block holds E MLPs
    and its router (E, h) instead of one MLP. The shapes are the block's own (`_block_shapes`):
    GPT-2's or Llama's (K and V of width h_kv, SwiGLU's gate, RMSNorm, no biases)."""
    V, h, s = model.padded_vocab_size, model.d_model, model.seq_len

    def moved(shapes: list[tuple[int, int]]) -> int:
        return sum(padded(d0, n) * rest for d0, rest in shapes)

    attention, mlp = (moved(shapes) for shapes in _block_shapes(model))
    moe_mlp = moved([(model.moe_experts, h)]) + model.moe_experts * mlp  # router, experts
    blocks = {f"blocks.{i}": attention + (moe_mlp if model.is_moe_block(i) else mlp) for i in range(model.n_layers)}
    positions = [] if model.rope else [(s, h)]
    head = [] if model.tied_head else [(V, h)]
    root = moved([(V, h), *positions, *_norm_shapes(model), *head])
    return {**blocks, "root": root}


def _norm_shapes(model: GPTConfig) -> list[tuple[int, int]]:
    """One norm's parameters as (rows, columns): a weight of h, and LayerNorm's bias of h."""
    return [(model.d_model, 1)] * (model.norm_parameters // model.d_model)


def _linear_shapes(rows: int, columns: int, bias: bool) -> list[tuple[int, int]]:
    return [(rows, columns)] + ([(rows, 1)] if bias else [])


def _block_shapes(model: GPTConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A block's parameters as (rows, columns), dim 0 first: (its two norms and attention, one MLP)."""
    h, h_kv, f, bias = model.d_model, model.kv_width, model.d_ff, model.bias
    attention = (2 * _norm_shapes(model) + _linear_shapes(h, h, bias) + 2 * _linear_shapes(h_kv, h, bias)
                 + _linear_shapes(h, h, bias))  # ln1, ln2, q, k, v, the output projection
    up = _linear_shapes(f, h, bias) * (2 if model.gated_mlp else 1)  # fc (and SwiGLU's gate)
    return attention, up + _linear_shapes(h, f, bias)


def fsdp2_comm(model: GPTConfig, layout: Layout) -> dict:
    """torch_fsdp2 (fully_shard per Block and on the root), per microbatch: each Block's group
    all-gathered before forward and again before backward, the root's once (FSDP2 keeps the root
    unsharded between its forward and backward), every group's gradients reduce-scattered once:
    (N-1)/N·(2·P_blocks + P_root + G) per rank and microbatch, on FSDP2's padded sizes."""
    n = layout.dims.dp
    ranks = layout.dims.world_size
    return figure(all_ranks(fsdp2_per_rank(model, layout, n), ranks), ranks,
                  extra={"padded_parameters": sum(fsdp2_group_padded_counts(model, n).values())})


def fsdp2_per_rank(model: GPTConfig, layout: Layout, n: int) -> dict[str, tuple[int, Fraction]]:
    """(payload, sent) per op of one rank of fsdp2_comm's FSDP2 over a group of n ranks."""
    m, B = layout.microbatches, layout.dtype_bytes
    groups = fsdp2_group_padded_counts(model, n)
    blocks = sum(v for k, v in groups.items() if k != "root") * B
    root = groups["root"] * B
    return {op: (payload, gather_or_scatter_sent_per_rank(n, payload))
            for op, payload in (("all_gather", m * (2 * blocks + root)), ("reduce_scatter", m * (blocks + root)))}


def torch_hsdp_comm(model: GPTConfig, layout: Layout) -> dict:
    """torch_hsdp (FSDP2 on the 2-D mesh (dp_replicate, dp_shard)): fsdp2_comm's traffic over the S =
    dp_shard ranks of the shard group, then, once per step (all-reduce asked for on the last
    microbatch only), each group's gradient shard all-reduced over the R = dp / dp_shard replicas:
    2(R-1)/R·Σ_groups padded/S·B per rank, on FSDP2's padded sizes for S."""
    s = layout.dims.dp_shard
    padded_count = sum(fsdp2_group_padded_counts(model, s).values())
    return hybrid_figure(fsdp2_per_rank(model, layout, s), padded_count * layout.dtype_bytes // s, layout,
                         extra={"padded_parameters": padded_count})


def torch_zero2_comm(model: GPTConfig, layout: Layout) -> dict:
    """torch_zero2 (FSDP2 with reshard_after_forward=False, kept unsharded between the microbatches of
    a step): every group all-gathered once per step, before the first forward, and its gradients
    reduce-scattered every microbatch: (N-1)/N·(P + m·G) per rank, our zero2's form on FSDP2's padding."""
    n, m, B = layout.dims.dp, layout.microbatches, layout.dtype_bytes
    groups = fsdp2_group_padded_counts(model, n)
    size = sum(groups.values()) * B
    per_rank = {op: (payload, gather_or_scatter_sent_per_rank(n, payload))
                for op, payload in (("all_gather", size), ("reduce_scatter", m * size))}
    ranks = layout.dims.world_size
    return figure(all_ranks(per_rank, ranks), ranks, extra={"padded_parameters": sum(groups.values())})


def torch_zero1_comm(model: GPTConfig, layout: Layout) -> dict:
    """torch_zero1 (DDP + ZeroRedundancyOptimizer): DDP all-reduces every gradient once per step,
    2(N-1)/N·G per rank, and after the step every parameter is broadcast from the rank that owns
    it. A broadcast of S bytes counts S on every rank of the group (comm.py's ring convention: in
    a pipelined broadcast each rank forwards what it receives), so the broadcasts add P = Ψ·B per
    rank whatever the partition: 2(N-1)/N·G + P, against our zero1's (N-1)/N·(G + P)."""
    n, B, ranks = layout.dims.dp, layout.dtype_bytes, layout.dims.world_size
    size = parameter_count(model) * B
    per_rank = {"all_reduce": (size, all_reduce_sent_per_rank(n, size)), "broadcast": (size, Fraction(size))}
    return figure(all_ranks(per_rank, ranks), ranks)


def torch_tp_comm(model: GPTConfig, layout: Layout) -> dict:
    """PyTorch DTensor tensor parallelism with parallel/baselines/dtensor_tp.py's plan (not Megatron's count).

    Per microbatch, with A = b·s·h·B the bytes of one activation:

      embedding   forward: the vocabulary-sharded lookups summed (RowwiseParallel)       1 all-reduce
      each layer  forward: attention and MLP outputs summed (RowwiseParallel)            2 all-reduces
                  backward: the input gradients of q, k, v and fc (and a gated MLP's
                  gate), each a ColwiseParallel whose Replicate input gets its own
                  Partial gradient                                                4 (SwiGLU: 5) all-reduces
      head        forward: the full logits all-gathered (output_layouts=Replicate())      b·s·V·B
                  backward: its input gradient summed                                     1 all-reduce

    so (6L + 2)·A all-reduced over tp ((7L + 2)·A with SwiGLU) against Megatron's (4L + 2)·A, and
    b·s·V·B gathered where Megatron's vocab-parallel loss all-reduces 3·b·s fp32 values. K/V heads,
    norms and biases change none of it (each activation is b·s·h whatever the kv heads; tp divides
    them here). With dp > 1 the local shards (Ψ_t, the same as Megatron's) are summed over dp.
    """
    dims, b, m, B = layout.dims, layout.microbatch_size, layout.microbatches, layout.dtype_bytes
    t, d = dims.tp, dims.dp
    activation = b * model.seq_len * model.d_model * B
    reduced = ((7 if model.gated_mlp else 6) * model.n_layers + 2) * m * activation
    logits = m * b * model.seq_len * model.padded_vocab_size * B
    dp_grads = tp_shard_parameter_count(model, t) * B if d > 1 else 0
    tp_sent = all_reduce_sent_per_rank(t, reduced) + gather_or_scatter_sent_per_rank(t, logits)
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    ranks = dims.world_size
    by_op = {
        "all_reduce": (reduced + dp_grads, all_reduce_sent_per_rank(t, reduced) + dp_sent),
        "all_gather": (logits, gather_or_scatter_sent_per_rank(t, logits)),
    }
    return figure(all_ranks(by_op, ranks), ranks, {"tp": tp_sent * ranks, "dp": dp_sent * ranks},
                  {"activation_bytes": activation})
