"""The gradient syncs: how the ranks that hold the same parameters agree on one update.

Every family that replicates parameters over some group (dp, and dp x cp under context
parallelism, each pipeline stage's dp group, the expert-data-parallel ranks of a mixture of
experts) ends its step with one of these. They sit one floor below the families so that no family
imports another: dp, zero, tp, cp, moe and the recipe all plug in the same syncs.

  allreduce.py  the all-reduce syncs: naive (one all-reduce per gradient after backward) and
                bucketed (DDP's flat buckets, all-reduced while backward goes on)
  shards.py     the machinery ZeRO is made of: each model part as one flat buffer padded to a
                multiple of the group size, an AdamW over this rank's shard, the reduce-scatter
  zero.py       ZeroOptimizer: ZeRO stage 1 or 2 over any group, the sync and the optimizer in one
  options.py    how the dp dimension syncs (parallel.grad_sync, bucket_mb, zero, comm_dtype): the options
                every family that replicates parameters reads, declared here as a family of their own
  quantize.py   the formats a collective may carry (bf16, block-scaled int8 and fp8), their error bounds
  lowprec.py    the all-reduce, reduce-scatter and all-gather in those formats, which the syncs call

Each sync is a `parallel.strategy.GradSync`: what a step calls after backward (`finish`), and the
completions other families hang on it (tp's sum of sequence-sharded gradients).
"""

from __future__ import annotations

from dataclasses import replace

from parallel.family import Family, Search
from parallel.layout import Layout
from parallel.spec import StrategySpec
from parallel.sync.options import ZERO_STAGES, SyncOptions, check_comm_dtype
from parallel.sync.quantize import BLOCK_SCALED


def _search(search: Search) -> list[SyncOptions]:
    """The ZeRO stages where the entry honours parallel.zero, each with the all-reduce syncs asked for, and
    where it honours parallel.comm_dtype each format asked for (plan.search.comm_dtype; fp32 alone by
    default), but the pairs a record refuses (a block-scaled format with the naive sync)."""
    spec, space = search.spec, search.space
    stages = space.get("zero", ZERO_STAGES) if spec.honours_option(SyncOptions, "zero") else (0,)
    formats = space.get("comm_dtype", ("fp32",)) if spec.honours_option(SyncOptions, "comm_dtype") else ("fp32",)
    return [SyncOptions(grad_sync=g, zero=z, comm_dtype=f) for z in stages for f in formats
            for g in space.get("grad_sync", ("bucketed",)) if not (f in BLOCK_SCALED and g == "naive")]


def _fallback(options: SyncOptions, reason: str) -> SyncOptions | None:
    """A layout that refuses the bucketed sync (virtual stages finish their backward apart) runs the naive one."""
    if "grad_sync" not in reason or options.grad_sync == "naive" or options.comm_dtype in BLOCK_SCALED:
        return None  # a block-scaled format has no naive sync to fall back on
    return replace(options, grad_sync="naive")


def all_reduce_sync(layout: Layout, spec: StrategySpec) -> bool:
    """Whether the layout's dp dimension runs parallel.grad_sync's all-reduce: the entry honours it,
    there is more than one dp rank, and no ZeRO stage replaces it."""
    return spec.honours_option(SyncOptions, "grad_sync") and layout.dims.dp > 1 and not layout.of(SyncOptions).zero


def _describe(layout: Layout, spec: StrategySpec) -> dict:
    """The options an entry does not honour are null, so a reader never mistakes them for facts."""
    options, all_reduce = layout.of(SyncOptions), all_reduce_sync(layout, spec)
    bucket_alone = spec.honours_option(SyncOptions, "bucket_mb") and not spec.honours_option(SyncOptions, "grad_sync")
    return {"grad_sync": options.grad_sync if all_reduce else None,
            "bucket_mb": options.bucket_mb if all_reduce or bucket_alone else None, "zero": options.zero,
            "comm_dtype": options.comm_dtype if spec.honours_option(SyncOptions, "comm_dtype") else None}


def _label(described: dict) -> list[str]:
    return ([f"zero{described['zero']}"] if described["zero"] else []) + \
        (["naive"] if described.get("grad_sync") == "naive" else []) + \
        ([described["comm_dtype"]] if described.get("comm_dtype") not in (None, "fp32") else [])


def _identity(layout: Layout, spec: StrategySpec) -> str:
    """The planner tells layouts apart by their effective ZeRO stage and all-reduce sync (a zero<k>
    strategy's stage is in its name), not by the record: of the record only the collectives' format."""
    return layout.of(SyncOptions).comm_dtype


FAMILY = Family("sync", SyncOptions, rules=check_comm_dtype, search=_search, describe=_describe, label=_label,
                identity=_identity, fallback=_fallback)
