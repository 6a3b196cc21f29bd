"""How the dp dimension syncs: the options of the gradient syncs, which every family plugs in.

They sit with the syncs, a floor below the families, because every family that replicates its
parameters reads them (dp, tp's dp x tp, the pipeline's stages, cp's dp x cp, the recipe), and one
family must never read another's options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from parallel.family import option
from parallel.spec import ConfigError
from parallel.sync.allreduce import GRAD_SYNCS
from parallel.sync.quantize import BLOCK_SCALED, COMM_DTYPES

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class SyncOptions:
    FAMILY: ClassVar[str] = "sync"

    # parallel.grad_sync: the all-reduce sync, "bucketed" (DDP's buckets, all-reduced while backward goes
    # on) or "naive" (one all-reduce per gradient after backward); where an entry honours it
    grad_sync: str = option("bucketed")
    # parallel.bucket_mb: the bucketed sync's bucket size in MiB (DDP's default; its first bucket is 1 MiB)
    bucket_mb: float = option(25.0)
    # parallel.zero: the ZeRO stage of the dp dimension; 0 is the plain all-reduce. On a pure dp layout
    # stage k runs as the strategy zero<k>; inside tp, pp, cp or 3d it is parallel/sync/zero.py's
    # ZeroOptimizer over the ranks that replicate the parameters (parallel/compose/route.py)
    zero: int = option(0)
    # parallel.comm_dtype: the format the dp group's gradient reductions (and ZeRO-3's weight
    # all-gathers) travel in: fp32 (as computed), bf16 (DDP's compression hook), or int8 / fp8 with a
    # scale per block of 256 (ZeRO++'s quantized collectives); parallel/sync/lowprec.py
    comm_dtype: str = option("fp32")

    def __post_init__(self):
        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"parallel.grad_sync={self.grad_sync!r}: choose one of {', '.join(GRAD_SYNCS)}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) \
                or not math.isfinite(self.bucket_mb) or self.bucket_mb <= 0:
            raise ConfigError(f"parallel.bucket_mb={self.bucket_mb!r} must be a positive number: PyTorch DDP uses 25")
        object.__setattr__(self, "bucket_mb", float(self.bucket_mb))
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ConfigError(f"parallel.zero={self.zero!r} is not a ZeRO stage: choose 0 (plain dp all-reduce), "
                              "1 or 2 (3 only with parallel.tp=1 parallel.pp=1)")
        if self.comm_dtype not in COMM_DTYPES:
            raise ConfigError(f"parallel.comm_dtype={self.comm_dtype!r}: choose one of {', '.join(COMM_DTYPES)}")
        if self.comm_dtype in BLOCK_SCALED and self.grad_sync == "naive":
            raise ConfigError(f"parallel.comm_dtype={self.comm_dtype} quantizes whole model parts, as the bucketed "
                              "sync cuts them: use parallel.grad_sync=bucketed")


def check_comm_dtype(check) -> None:
    """The sync family's rule: a format other than fp32 only where the entry that runs reads it (dp,
    zero1-3; torch_ddp, whose counterpart is PyTorch's bf16 hook, bf16 alone)."""
    fmt = check.layout.of(SyncOptions).comm_dtype
    if fmt == "fp32":
        return
    if not check.spec.honours_option(SyncOptions, "comm_dtype"):
        raise ConfigError(f"parallel.comm_dtype={fmt}: {check.spec.name} reduces in fp32 only; the low-precision "
                          "collectives are dp's and ZeRO's (parallel=dp, zero1, zero2, zero3, torch_ddp with bf16)")
    if fmt in BLOCK_SCALED and "baseline" in check.spec.tags:
        raise ConfigError(f"parallel.comm_dtype={fmt}: PyTorch's DDP ships a bf16 compression hook, no block-scaled "
                          f"{fmt} one: use parallel.comm_dtype=bf16, or parallel=dp for {fmt}")
