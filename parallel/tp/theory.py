"""Tensor parallelism's closed forms: the Megatron collectives per step (docs/theory/tensor-parallel.md).

Like every theory file, independent of the code it checks: the collectives are counted from the
block's regions in closed form, the shard Ψ_t from the GPT formula (parallel/algebra.py), never
from the model's tensors or the communication log.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from parallel.algebra import (
    FP32_BYTES,
    all_ranks,
    all_reduce_sent_per_rank,
    figure,
    gather_or_scatter_sent_per_rank,
    sequence_sharded_parameter_count,
    tp_shard_parameter_count,
)
from parallel.core.model import GPTConfig
from parallel.layout import Layout


def tp_tensors_per_layer(recompute: str) -> int:
    """Activation tensors of b·s·h one block's tensor-parallel regions move per microbatch: 2 in
    forward (attention and MLP outputs summed), 2 in backward (their input gradients summed), and
    under full recomputation the forward's 2 again in backward: 4, or 6 (selective: 4, the core
    it re-runs has no tp collective)."""
    return 6 if recompute == "full" else 4


def tp_regathers_per_microbatch(layout: Layout, layers: int, last: bool) -> int:
    """Tensors of b·s·h all-gathered once more in backward per microbatch where the column-parallel
    linears keep their input's sequence piece (`Cut.saves_shard`): their weight gradients need it
    whole. One per region that opens with column-parallel linears: attention (Q, K, V share one) and
    MLP in each of the `layers` blocks, and the vocab-parallel head where `last`: 2L + 1 for the
    whole model (none otherwise; full recomputation's second forward all-gathers as the first did,
    counted in `tp_tensors_per_layer`)."""
    return 2 * layers + last if layout.cut().saves_shard else 0


@dataclass(frozen=True)
class StagePayloads:
    """What one tp rank of a stage hands its tp collectives per step, in bytes, by op."""

    all_reduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0

    def sent(self, t: int) -> Fraction:
        """What the rank sends: 2(t-1)/t of what it all-reduces, (t-1)/t of the rest."""
        return all_reduce_sent_per_rank(t, self.all_reduce) + gather_or_scatter_sent_per_rank(
            t, self.all_gather + self.reduce_scatter)


def kv_replica_grad_count(model: GPTConfig, t: int, layers: int) -> int:
    """Elements of the once-per-step kv-replica gradient all-reduce (`tp/kv_grads`) of a stage holding
    `layers` blocks, over t tp ranks: zero where t divides the kv heads (each rank holds its own);
    where t is a multiple of them, one slot per kv head of K's and V's weights (and biases), the
    whole K and V of every block, 2·(h·h_kv + h_kv) per block (h·h_kv without biases)."""
    if model.kv_heads % t == 0:
        return 0
    return layers * 2 * (model.d_model + model.bias) * model.kv_width


def tp_stage_payloads(model: GPTConfig, layout: Layout, layers: int, first: bool, last: bool,
                      completions: int = 1) -> StagePayloads:
    """The tp collectives of one rank of a stage holding `layers` blocks, the embedding where `first`
    and the head and loss where `last` (the whole model: L, True, True), per step: see `tp_comm`.
    Under context parallelism every activation is this rank's s/cp tokens of each sequence.
    `completions`: how often a step sums the partial gradients over tp (the sequence-sharded ones, the
    kv replicas'): once, or once per microbatch where ZeRO-2 reduces every microbatch's over dp."""
    dims, cut, m, B = layout.dims, layout.cut(), layout.microbatches, layout.dtype_bytes
    s, h = model.seq_len // dims.cp, model.d_model
    activation = layout.microbatch_size * s * h * B
    activations = (tp_tensors_per_layer(layout.recompute) * layers + first + last) * m * activation
    loss = 3 * m * layout.microbatch_size * s * FP32_BYTES if last else 0
    kv_grads = kv_replica_grad_count(model, dims.tp, layers) * B * completions
    if not cut.sequence_parallel:
        return StagePayloads(all_reduce=activations + loss + kv_grads)
    regathered = tp_regathers_per_microbatch(layout, layers, last) * m * activation
    sharded = sequence_sharded_parameter_count(model, layers, first, last) * B * completions  # their grads
    return StagePayloads(all_reduce=loss + sharded + kv_grads, all_gather=activations + regathered,
                         reduce_scatter=activations)


def tp_comm(model: GPTConfig, layout: Layout) -> dict:
    """Tensor parallelism, tp and tp_sp (with sequence parallelism, and data parallelism across tp groups).

    Per microbatch, every activation collective moves one tensor of b·s·h elements (the full
    sequence; under sequence parallelism the payload of an all-gather is its full output and of
    a reduce-scatter its full input, the same b·s·h):

      embedding      forward: the partial token embeddings summed                 1
      each layer     forward: attention and MLP outputs summed (row-parallel)     2
                     backward: the input gradients of attention and MLP summed    2
                     (Q/K/V and fc are column-parallel: each rank holds part of it)
      head           backward: the input gradient of the vocab-parallel head     1

    4L + 2 tensors of b·s·h per microbatch. Without sequence parallelism each is one all-reduce
    (2(t-1)/t of its bytes sent per rank): per layer 8·b·s·h·(t-1)/t elements (docs/theory/tensor-parallel.md).
    With it, each all-reduce is an all-gather plus a reduce-scatter ((t-1)/t each, the same bytes;
    the embedding and the head become a reduce-scatter forward + all-gather backward and an
    all-gather forward + reduce-scatter backward). With the sequence piece saved each of the 2L + 1
    regions that open with column-parallel linears all-gathers its input once more in backward
    (`tp/<part>/regather`, `tp_regathers_per_microbatch`): 6L + 3 all-gathers' worth of b·s·h per
    microbatch against the reduce-scatters' 4L + 2. The vocab-parallel cross-entropy adds three
    all-reduces of b·s fp32 values (row max, sum of exponentials, target logit). Once per step,
    sequence parallelism all-reduces the gradients of the sequence-sharded replicated parameters
    over tp (the norms' weights, and biases where the model has them; the position table where it
    is learned: `sequence_sharded_parameter_count`); where tp exceeds the kv heads, the K and V
    gradients of every block are all-reduced over tp (`kv_replica_grad_count`); and data
    parallelism all-reduces every local gradient (Ψ_t of them) over dp.

    Under full recomputation (train.recompute=full) each block's forward runs again in backward,
    its two forward collectives with it: 6 tensors per layer instead of 4, 12·b·s·h·(t-1)/t
    elements sent per rank per layer instead of 8 (`tp_tensors_per_layer`). Selective
    recomputation re-runs only the attention core, which under tensor parallelism sends nothing.
    """
    dims, B = layout.dims, layout.dtype_bytes
    t, d = dims.tp, dims.dp
    tp = tp_stage_payloads(model, layout, model.n_layers, True, True)
    by_op = {op: (payload, gather_or_scatter_sent_per_rank(t, payload))
             for op, payload in (("all_gather", tp.all_gather), ("reduce_scatter", tp.reduce_scatter)) if payload}
    tp_sent = tp.sent(t)
    dp_grads = tp_shard_parameter_count(model, t) * B if d > 1 else 0
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    by_op["all_reduce"] = (tp.all_reduce + dp_grads, all_reduce_sent_per_rank(t, tp.all_reduce) + dp_sent)
    ranks = dims.world_size
    extra = {
        # The Megatron count a run's comm.by_tag_op shows for every block, per rank.
        "per_layer_per_microbatch": per_layer_counts(layout),
        "activation_bytes": layout.microbatch_size * model.seq_len * model.d_model * B,
    }
    return figure(all_ranks(by_op, ranks), ranks, {"tp": tp_sent * ranks, "dp": dp_sent * ranks}, extra)


def per_layer_counts(layout: Layout) -> dict:
    """The tp collectives of every block per microbatch, by tag kind: forward, backward, the forward
    again under full recomputation, the inputs gathered again where the sequence piece is saved."""
    cut = layout.cut()
    per_layer = {"all_gather": 2, "reduce_scatter": 2} if cut.sequence_parallel else {"all_reduce": 2}
    counts = {"fwd": per_layer, "bwd": per_layer}
    if layout.recompute == "full":  # tagged `tp/<part>/fwd` too
        counts["recompute"] = per_layer
    if cut.saves_shard:
        counts["regather"] = {"all_gather": 2}
    return counts
