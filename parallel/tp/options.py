"""Tensor parallelism's options: sequence parallelism, and what a column-parallel linear saves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from parallel.dist.dims import LayoutError, ParallelDims
from parallel.family import option
from parallel.spec import ConfigError

TP_SAVES = ("gathered", "sharded")


@dataclass(frozen=True)
class TPOptions:
    FAMILY: ClassVar[str] = "tp"

    # parallel.sequence_parallel: between the tensor-parallel regions the norms, dropout and the residual
    # stream are cut along the sequence over the tp ranks (all-gather in, reduce-scatter out: Megatron's SP)
    sequence_parallel: bool = option(False)
    # parallel.tp_saves, under sequence parallelism: what each column-parallel linear keeps for its weight
    # gradient, the all-gathered input ("gathered") or this rank's piece of it, gathered again in
    # backward ("sharded", as Megatron-LM does; parallel/tp/regions.py)
    saves: str = option("gathered", key="tp_saves")

    def __post_init__(self):
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"parallel.sequence_parallel={self.sequence_parallel!r} must be true or false")
        if self.saves not in TP_SAVES:
            raise LayoutError(
                f"parallel.tp_saves={self.saves!r} is not one of {', '.join(TP_SAVES)}: gathered keeps each "
                "column-parallel linear's all-gathered input for backward, sharded keeps this rank's piece of the "
                "sequence and gathers it again in backward"
            )

    def cut(self, dims: ParallelDims) -> dict:
        """Sequence parallelism cuts only over tp > 1 ranks, and the piece is saved only where it cuts."""
        sp = self.sequence_parallel and dims.tp > 1
        return {"sequence_parallel": sp, "saves_shard": sp and self.saves == "sharded"}
