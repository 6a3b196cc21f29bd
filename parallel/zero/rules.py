"""ZeRO's refusals: where parallel.zero means nothing, and where a stage cannot run.

parallel.zero sets how the dp dimension syncs. The table of parallel/compose/route.py says which
entry runs each (requested strategy, layout, stage) and, where none can, names one of the
refusals below; each says why in one line and how to fix it. All of them run before any process
group exists.
"""

from __future__ import annotations

from parallel.dist.dims import LayoutError, ParallelDims
from parallel.spec import ConfigError

ZERO_STAGES = (0, 1, 2, 3)
ZERO3_NO_TIED_HEAD = ("zero3 gathers each part's flat buffer around the part's forward and frees it after, and the "
                      "shared table is the embedding's part: the head would compute with a freed weight")


def check_stage(zero) -> None:
    """parallel.zero is 0 (a plain all-reduce), 1, 2 or 3."""
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ConfigError(f"parallel.zero={zero!r} is not a ZeRO stage: choose 0 (plain dp all-reduce), 1 or 2 "
                          "(3 only with parallel.tp=1 parallel.pp=1)")


def no_dp_sync(name: str, dims: ParallelDims, zero: int) -> None:
    """The entry reached has no dp sync to replace (PyTorch's own, ep, or a zero<k> already)."""
    why = "is a ZeRO stage already" if name.startswith("zero") else "has no such dp sync"
    raise ConfigError(f"parallel.zero={zero} sets the ZeRO stage of the dp dimension of parallel=dp, tp, pp, cp or "
                      f"3d, but parallel={name} {why}: set parallel.zero=0")


def zero3_with_cp(name: str, dims: ParallelDims, zero: int) -> None:
    """Under context parallelism ZeRO-1/2 shard over the dp·cp ranks; ZeRO-3 is no dp sync at all."""
    raise ConfigError(
        f"parallel.zero=3 does not compose with parallel.cp={dims.cp}: ZeRO-3 is a strategy of its own "
        "(parallel=zero3, parameters gathered and freed by hooks around each part of the whole model), not a "
        "dp sync that the cp strategy or the 3d recipe can plug in; use parallel.zero=1 or 2"
    )


def one_dp_rank(name: str, dims: ParallelDims, zero: int) -> None:
    """Nothing to shard over."""
    raise LayoutError(
        f"parallel.zero={zero} shards over the data-parallel ranks, but parallel.dp={dims.dp} "
        f"(world {dims.world_size} = dp {dims.dp} x tp {dims.tp} x pp {dims.pp}): "
        "use at least 2 dp ranks, or parallel.zero=0"
    )


def zero3_with_tp_pp(name: str, dims: ParallelDims, zero: int) -> None:
    """ZeRO-3's gathers and frees do not fit inside the tp and pp strategies."""
    raise ConfigError(
        f"parallel.zero=3 does not compose with parallel.tp={dims.tp} parallel.pp={dims.pp} here: "
        "ZeRO-3 all-gathers "
        "each part's parameters before every microbatch's forward and again before its backward (2m gathers of "
        "every stage per step under a pipeline schedule, which wants m large), reduce-scatters gradients inside "
        "backward (before sequence parallelism's tp sum of partial gradients) and frees parameters that the tp and "
        "pp strategies read; use parallel.zero=1 or 2, or parallel=zero3 with parallel.tp=1 parallel.pp=1"
    )


def check_hsdp(dims: ParallelDims) -> None:
    """HSDP shards over groups of dp_shard ranks and replicates over dp / dp_shard of them: both at least 2
    (ParallelDims.resolve has already refused a dp_shard that does not divide dp)."""
    if dims.dp_shard < 2:
        raise LayoutError(f"parallel.dp_shard={dims.dp_shard} shards the model state over one rank, which is plain "
                          "data parallelism: use parallel.dp_shard=2 or more (the processes per node), or parallel=dp")
    if dims.dp // dims.dp_shard < 2:
        raise LayoutError(f"parallel.dp_shard={dims.dp_shard} = parallel.dp={dims.dp} leaves one shard group and "
                          "nothing to replicate across: use a dp_shard that divides dp at most dp/2 "
                          f"(e.g. parallel.dp_shard={max(2, dims.dp // 2)}), or parallel=zero3 to shard over all of dp")
