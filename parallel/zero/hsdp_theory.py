"""HSDP's closed forms: the bytes per step of each of its two groups, and the model state per rank.

Like every theory file, independent of the code it checks. With S = dp_shard ranks per shard group,
R = dp / dp_shard shard groups (the size of a replicate group), m microbatches, B bytes per element
and Ψ_S = Ψ_pad for S ranks (algebra.zero_padded_parameter_count(model, S)), so that one rank's
gradient shard is G_S = Ψ_S·B / S bytes, each rank sends per step:

  dp_shard      ZeRO-3 (`hsdp`):       m·(S-1)/S·(2P + G)     ZeRO over the S ranks of its shard group,
                ZeRO-2 (`hsdp_zero2`): (S-1)/S·(m·G + P)      exactly zero_comm's forms with N = S
                                                              (P = G = Ψ_S·B)
  dp_replicate  both:                  2(R-1)/R·G_S           one ring all-reduce of its gradient shard,
                                                              once per step, over the R ranks that hold it

With the shard group inside a node and the replicate groups across nodes, the second line is all
that crosses the slow links: ZeRO-3 over all N = S·R ranks sends m·(N-1)/N·3Ψ·B per rank, most of it
between nodes; HSDP sends 2(R-1)/R·Ψ_S·B/S there (docs/hsdp.md works the ratio out).
"""

from __future__ import annotations

from fractions import Fraction

from parallel.algebra import all_ranks, all_reduce_sent_per_rank, figure, zero_padded_parameter_count
from parallel.core.model import GPTConfig
from parallel.layout import Layout
from parallel.zero.theory import zero_per_rank, zero_state_over

SHARD_GROUP, REPLICATE_GROUP = "dp_shard", "dp_replicate"  # the groups' names in the log and in `by_group`


def gradient_shard_bytes(model: GPTConfig, layout: Layout) -> int:
    """G_S: one rank's shard of the padded gradients, Ψ_S·B / S bytes (what the replicate group all-reduces)."""
    s = layout.dims.dp_shard
    return zero_padded_parameter_count(model, s) * layout.dtype_bytes // s


def hsdp_comm(model: GPTConfig, layout: Layout, stage: int) -> dict:
    """Every rank alike: ZeRO stage `stage` over its shard group, then one all-reduce of its gradient
    shard over its replicate group; bytes by op and by group, summed over all ranks."""
    s = layout.dims.dp_shard
    return hybrid_figure(zero_per_rank(model, layout, stage, s), gradient_shard_bytes(model, layout), layout,
                         extra={"padded_parameters": zero_padded_parameter_count(model, s)})


def hybrid_figure(shard_ops: dict[str, tuple[int, Fraction]], gradient_shard: int, layout: Layout,
                  extra: dict) -> dict:
    """The expected_comm block of any HSDP: `shard_ops` (payload, sent per op of one rank in its shard
    group), then a ring all-reduce of `gradient_shard` bytes over the R = dp / dp_shard replicas,
    2(R-1)/R of it per rank; by op and by group (SHARD_GROUP, REPLICATE_GROUP), summed over all ranks."""
    ranks = layout.dims.world_size
    replicate_sent = all_reduce_sent_per_rank(layout.dims.dp // layout.dims.dp_shard, gradient_shard)
    per_rank = {**shard_ops, "all_reduce": (gradient_shard, replicate_sent)}
    by_group = {SHARD_GROUP: sum((sent for _, sent in shard_ops.values()), Fraction(0)) * ranks,
                REPLICATE_GROUP: replicate_sent * ranks}
    return figure(all_ranks(per_rank, ranks), ranks, by_group=by_group,
                  extra={**extra, "gradient_shard_bytes": gradient_shard})


def hsdp_model_state_bytes(model: GPTConfig, layout: Layout, stage: int) -> dict:
    """ZeRO stage `stage`'s model state over the S ranks of a shard group (the replicas hold the same):

        hsdp_zero2  4Ψ + (4 + 8)Ψ/S      hsdp  16Ψ/S      (Ψ = Ψ_pad for S ranks)
    """
    return zero_state_over(model, layout, stage, layout.dims.dp_shard)
