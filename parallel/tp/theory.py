"""Tensor parallelism's closed forms: the Megatron collectives per step (docs/theory/tensor-parallel.md).

Like every theory file, independent of the code it checks: the collectives are counted from the
block's regions in closed form, the shard Ψ_t from the GPT formula (parallel/algebra.py), never
from the model's tensors or the communication log.
"""

from __future__ import annotations

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


def saves_sequence_piece(layout: Layout) -> bool:
    """parallel.tp_saves=sharded where it means something: sequence parallelism over tp > 1 ranks."""
    return layout.sequence_parallel and layout.tp_saves == "sharded" and layout.dims.tp > 1


def tp_regathers_per_microbatch(cfg: GPTConfig, layout: Layout) -> int:
    """Tensors of b·s·h all-gathered once more in backward per microbatch under parallel.tp_saves=sharded:
    each region's column-parallel linears kept the sequence piece of their input, and their weight
    gradients need it whole. One per region that opens with column-parallel linears: attention
    (Q, K, V share one) and MLP in every block, and the vocab-parallel head: 2L + 1 (none otherwise;
    full recomputation's second forward all-gathers as the first did, counted in `tp_tensors_per_layer`)."""
    return 2 * cfg.n_layers + 1 if saves_sequence_piece(layout) else 0


def tp_comm(cfg: GPTConfig, layout: Layout) -> dict:
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
    all-gather forward + reduce-scatter backward). With parallel.tp_saves=sharded each of the 2L + 1
    regions that open with column-parallel linears all-gathers its input once more in backward
    (`tp/<part>/regather`, `tp_regathers_per_microbatch`): 6L + 3 all-gathers' worth of b·s·h per
    microbatch against the reduce-scatters' 4L + 2. The vocab-parallel cross-entropy adds three
    all-reduces of b·s fp32 values (row max, sum of exponentials, target logit). Once per step,
    sequence parallelism all-reduces the gradients of the sequence-sharded replicated parameters
    over tp, and data parallelism all-reduces every local gradient (Ψ_t of them) over dp.

    Under full recomputation (train.recompute=full) each block's forward runs again in backward,
    its two forward collectives with it: 6 tensors per layer instead of 4, 12·b·s·h·(t-1)/t
    elements sent per rank per layer instead of 8 (`tp_tensors_per_layer`). Selective
    recomputation re-runs only the attention core, which under tensor parallelism sends nothing.
    """
    dims, b, m, B = layout.dims, layout.microbatch_size, layout.microbatches, layout.dtype_bytes
    t, d = dims.tp, dims.dp
    activation = b * cfg.seq_len * cfg.d_model * B
    activations = (tp_tensors_per_layer(layout.recompute) * cfg.n_layers + 2) * m * activation  # all of one step
    loss = 3 * m * b * cfg.seq_len * FP32_BYTES
    by_op: dict[str, tuple[int, Fraction]] = {}
    tp_reduced = loss  # bytes all-reduced over tp
    regathered = tp_regathers_per_microbatch(cfg, layout) * m * activation
    if layout.sequence_parallel:
        gathered = activations + regathered
        by_op["all_gather"] = (gathered, gather_or_scatter_sent_per_rank(t, gathered))
        by_op["reduce_scatter"] = (activations, gather_or_scatter_sent_per_rank(t, activations))
        tp_reduced += sequence_sharded_parameter_count(cfg) * B
        per_layer = {"all_gather": 2, "reduce_scatter": 2}
    else:
        tp_reduced += activations
        per_layer = {"all_reduce": 2}
    counts = {"fwd": per_layer, "bwd": per_layer}
    if layout.recompute == "full":  # the forward's collectives once more, in backward (tagged `tp/<part>/fwd` too)
        counts["recompute"] = per_layer
    if regathered:  # attention's and the MLP's inputs, gathered again in backward
        counts["regather"] = {"all_gather": 2}
    tp_sent = all_reduce_sent_per_rank(t, tp_reduced) + sum(
        (by_op[op][1] for op in ("all_gather", "reduce_scatter") if op in by_op), Fraction(0))
    dp_grads = tp_shard_parameter_count(cfg, t) * B if d > 1 else 0
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    by_op["all_reduce"] = (tp_reduced + dp_grads, all_reduce_sent_per_rank(t, tp_reduced) + dp_sent)
    ranks = dims.world_size
    extra = {
        # The Megatron count a run's comm.by_tag_op shows for every block, per rank.
        "per_layer_per_microbatch": counts,
        "activation_bytes": activation,
    }
    return figure(all_ranks(by_op, ranks), ranks, {"tp": tp_sent * ranks, "dp": dp_sent * ranks}, extra)
