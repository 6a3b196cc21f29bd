"""Closed-form figures every run is checked against (formulas from REFERENCES.md).

Deliberately independent of the code it checks: parameter counts come from the GPT formula, not
from summing the model's tensors, and bytes from the per-strategy formulas, not from the
communication log's per-call arithmetic. Bytes are exact Fractions so that a test can assert
equality to the byte.
"""

from __future__ import annotations

from fractions import Fraction

from .dims import ParallelDims
from .model import GPTConfig

FP32_BYTES = 4


def parameter_count(cfg: GPTConfig) -> int:
    """Ψ = V·h + s·h + L·(12h² + 13h) + 2h + V·h (untied head), V the padded vocabulary.

    Per layer: Q, K, V and output projections 4h² + 4h, MLP 8h² + 5h (fc with bias 4h, proj with
    bias h), two LayerNorms 4h. The final LayerNorm adds 2h; the untied head V·h (no bias).
    """
    V, h, s, L = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers
    # The formula assumes the MLP is 4h wide; a different ratio changes the 12h² + 13h term.
    mlp = 2 * cfg.mlp_ratio * h * h + cfg.mlp_ratio * h + h
    per_layer = 4 * h * h + 4 * h + mlp + 4 * h
    return V * h + s * h + L * per_layer + 2 * h + V * h


def tp_shard_parameter_count(cfg: GPTConfig, t: int) -> int:
    """Ψ_t, the parameters one tensor-parallel rank holds (Ψ_1 = Ψ), f = mlp_ratio·h the MLP width:

        V·h/t (token rows) + s·h (positions, replicated) + 2h (final norm) + V·h/t (head rows)
        + L·[ 4h (two norms) + 3(h² + h)/t (Q, K, V: columns and their bias)
              + h²/t + h (output projection: its input columns, the full bias)
              + (f·h + f)/t (fc: columns and bias) + f·h/t + h (proj: input columns, full bias) ]
    """
    V, h, s, L, f = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers, cfg.d_ff
    per_layer = 4 * h + 3 * (h * h + h) // t + h * h // t + h + (f * h + f) // t + f * h // t + h
    return V * h // t + s * h + L * per_layer + 2 * h + V * h // t


def sequence_sharded_parameter_count(cfg: GPTConfig) -> int:
    """Replicated parameters whose gradient is partial under sequence parallelism: per layer two
    LayerNorms (4h) and two row-parallel biases (2h, added after the reduce-scatter), the final
    LayerNorm (2h) and the position table (s·h, each rank adds only its piece's positions)."""
    h, s, L = cfg.d_model, cfg.seq_len, cfg.n_layers
    return L * 6 * h + 2 * h + s * h


def all_reduce_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    return Fraction(2 * (n - 1), n) * payload_bytes if n > 1 else Fraction(0)


def gather_or_scatter_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    return Fraction(n - 1, n) * payload_bytes


def _figure(totals_by_op: dict[str, tuple[int, Fraction]], ranks: int, extra: dict | None = None) -> dict:
    """(payload, sent) per op summed over all ranks -> the summary's expected_comm block."""
    by_op = {
        op: {"payload_bytes": payload, "sent_bytes": float(sent), "sent_bytes_exact": str(sent)}
        for op, (payload, sent) in totals_by_op.items()
    }
    total = sum((sent for _, sent in totals_by_op.values()), Fraction(0))
    return {
        "sent_bytes_per_step": float(total),
        "sent_bytes_per_step_exact": str(total),
        "sent_bytes_per_rank_per_step": float(total / ranks),  # the mean, where ranks differ
        "by_op": by_op,
        **(extra or {}),
    }


def pipeline_p2p_bytes(model_cfg: GPTConfig, microbatch_size: int, microbatches: int, stages: int, virtual: int,
                       dtype_bytes: int = FP32_BYTES) -> int:
    """Narayanan §3.2: b·s·h·B per microbatch per stage boundary in each direction, so
    2·m·(v·p-1)·b·s·h·B per step for one pipeline (v = 1 for GPipe and 1F1B)."""
    activation = microbatch_size * model_cfg.seq_len * model_cfg.d_model * dtype_bytes
    return 2 * microbatches * (virtual * stages - 1) * activation


def _tp_comm(cfg: GPTConfig, dims: ParallelDims, b: int, m: int, sequence_parallel: bool, B: int) -> dict:
    """Tensor parallelism (with sequence parallelism, and data parallelism across tp groups).

    Per microbatch, every activation collective moves one tensor of b·s·h elements (the full
    sequence; under sequence parallelism the payload of an all-gather is its full output and of
    a reduce-scatter its full input, the same b·s·h):

      embedding      forward: the partial token embeddings summed                 1
      each layer     forward: attention and MLP outputs summed (row-parallel)     2
                     backward: the input gradients of attention and MLP summed    2
                     (Q/K/V and fc are column-parallel: each rank holds part of it)
      head           backward: the input gradient of the vocab-parallel head     1

    4L + 2 tensors of b·s·h per microbatch. Without sequence parallelism each is one all-reduce
    (2(t-1)/t of its bytes sent per rank): per layer 8·b·s·h·(t-1)/t elements (REFERENCES.md).
    With it, each all-reduce is an all-gather plus a reduce-scatter ((t-1)/t each, the same bytes;
    the embedding and the head become a reduce-scatter forward + all-gather backward and an
    all-gather forward + reduce-scatter backward). The vocab-parallel cross-entropy adds three
    all-reduces of b·s fp32 values (row max, sum of exponentials, target logit). Once per step,
    sequence parallelism all-reduces the gradients of the sequence-sharded replicated parameters
    over tp, and data parallelism all-reduces every local gradient (Ψ_t of them) over dp.
    """
    t, d = dims.tp, dims.dp
    activation = b * cfg.seq_len * cfg.d_model * B
    activations = (4 * cfg.n_layers + 2) * m * activation  # all such tensors of one step
    loss = 3 * m * b * cfg.seq_len * FP32_BYTES
    by_op: dict[str, tuple[int, Fraction]] = {}
    tp_reduced = loss  # bytes all-reduced over tp
    if sequence_parallel:
        by_op["all_gather"] = by_op["reduce_scatter"] = (activations, gather_or_scatter_sent_per_rank(t, activations))
        tp_reduced += sequence_sharded_parameter_count(cfg) * B
        per_layer = {"all_gather": 2, "reduce_scatter": 2}
    else:
        tp_reduced += activations
        per_layer = {"all_reduce": 2}
    tp_sent = all_reduce_sent_per_rank(t, tp_reduced) + 2 * by_op.get("all_gather", (0, Fraction(0)))[1]
    dp_grads = tp_shard_parameter_count(cfg, t) * B if d > 1 else 0
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    by_op["all_reduce"] = (tp_reduced + dp_grads, all_reduce_sent_per_rank(t, tp_reduced) + dp_sent)
    ranks = dims.world_size
    totals = {op: (payload * ranks, sent * ranks) for op, (payload, sent) in by_op.items()}
    extra = {
        "by_group": {g: {"sent_bytes": float(v * ranks), "sent_bytes_exact": str(v * ranks)}
                     for g, v in (("tp", tp_sent), ("dp", dp_sent)) if v},
        # The Megatron count a run's comm.by_tag_op shows for every block, per rank.
        "per_layer_per_microbatch": {"fwd": per_layer, "bwd": per_layer},
        "activation_bytes": activation,
    }
    return _figure(totals, ranks, extra)


def _torch_tp_comm(cfg: GPTConfig, dims: ParallelDims, b: int, m: int, B: int) -> dict:
    """PyTorch DTensor tensor parallelism with native_tp.py's plan (not Megatron's count).

    Per microbatch, with A = b·s·h·B the bytes of one activation:

      embedding   forward: the vocabulary-sharded lookups summed (RowwiseParallel)       1 all-reduce
      each layer  forward: attention and MLP outputs summed (RowwiseParallel)            2 all-reduces
                  backward: the input gradients of q, k, v and fc, each a ColwiseParallel
                  whose Replicate input gets its own Partial gradient                      4 all-reduces
      head        forward: the full logits all-gathered (output_layouts=Replicate())      b·s·V·B
                  backward: its input gradient summed                                     1 all-reduce

    so (6L + 2)·A all-reduced over tp against Megatron's (4L + 2)·A, and b·s·V·B gathered where
    Megatron's vocab-parallel loss all-reduces 3·b·s fp32 values. With dp > 1 the local shards
    (Ψ_t, the same as Megatron's) are summed over dp.
    """
    t, d = dims.tp, dims.dp
    activation = b * cfg.seq_len * cfg.d_model * B
    reduced = (6 * cfg.n_layers + 2) * m * activation
    logits = m * b * cfg.seq_len * cfg.padded_vocab_size * B
    dp_grads = tp_shard_parameter_count(cfg, t) * B if d > 1 else 0
    tp_sent = all_reduce_sent_per_rank(t, reduced) + gather_or_scatter_sent_per_rank(t, logits)
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    ranks = dims.world_size
    by_op = {
        "all_reduce": (reduced + dp_grads, all_reduce_sent_per_rank(t, reduced) + dp_sent),
        "all_gather": (logits, gather_or_scatter_sent_per_rank(t, logits)),
    }
    totals = {op: (payload * ranks, sent * ranks) for op, (payload, sent) in by_op.items()}
    extra = {"by_group": {g: {"sent_bytes": float(v * ranks), "sent_bytes_exact": str(v * ranks)}
                          for g, v in (("tp", tp_sent), ("dp", dp_sent)) if v},
             "activation_bytes": activation}
    return _figure(totals, ranks, extra)


def expected_comm(strategy: str, model_cfg: GPTConfig, dims: ParallelDims, *, microbatch_size: int = 1,
                  microbatches: int = 1, virtual: int = 1, sequence_parallel: bool = False,
                  dtype_bytes: int = FP32_BYTES) -> dict:
    """Strategy traffic per optimizer step, summed over all ranks, in the summary's schema.

    single: nothing crosses between ranks.
    dp (naive, bucketed, torch_ddp): one all-reduce of all gradients per step, 2(N-1)/N · Ψ·B per
    rank, whatever the bucketing and however many microbatches are accumulated.
    pp: every activation and its gradient crosses each boundary once per microbatch (sends; a
    receive sends nothing), in each of the dp pipelines; with dp > 1 each stage then all-reduces
    its own parameters over dp, which sums to 2(dp-1)/dp · Ψ·B per pipeline rank position, i.e.
    2(dp-1) · Ψ·B over all ranks.
    tp: see `_tp_comm` (microbatch_size b sequences, `microbatches` m per step).
    """
    psi = parameter_count(model_cfg)
    if strategy == "single" or dims.world_size == 1:
        return _figure({}, dims.world_size)
    if strategy in ("dp", "torch_ddp", "accelerate_ddp"):
        grads = psi * dtype_bytes
        return _figure({"all_reduce": (grads * dims.world_size, all_reduce_sent_per_rank(dims.dp, grads) * dims.world_size)},
                       dims.world_size)
    if strategy in ("pp", "torch_pp"):  # torch's stages send the same activations and gradients
        b = microbatch_size
        p2p = pipeline_p2p_bytes(model_cfg, b, microbatches, dims.pp, virtual, dtype_bytes) * dims.dp
        totals = {}
        if p2p:
            totals = {"send": (p2p, Fraction(p2p)), "recv": (p2p, Fraction(0))}
        if dims.dp > 1:
            grads = psi * dtype_bytes  # summed over the stages of one pipeline
            totals["all_reduce"] = (grads * dims.dp, all_reduce_sent_per_rank(dims.dp, grads) * dims.dp)
        return _figure(totals, dims.world_size)
    if strategy == "torch_tp":
        return _torch_tp_comm(model_cfg, dims, microbatch_size, microbatches, dtype_bytes)
    if strategy == "tp":
        return _tp_comm(model_cfg, dims, microbatch_size, microbatches, sequence_parallel, dtype_bytes)
    raise ValueError(f"theory has no formula for strategy {strategy!r}")
