"""Pipeline parallelism's options: the schedule, the chunks per rank, how the layers split, and how
the sends and receives are posted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from parallel.family import option
from parallel.pp.posting import CHOICES
from parallel.pp.schedules import SCHEDULES
from parallel.spec import ConfigError


@dataclass(frozen=True)
class PPOptions:
    FAMILY: ClassVar[str] = "pp"

    # parallel.schedule: the order of forwards and backwards on every rank (parallel/pp/schedules.py:
    # gpipe, 1f1b, interleaved_1f1b, zbh1, zbv, dualpipev, and any registered at run time)
    schedule: str = option("1f1b")
    # parallel.virtual_stages: model chunks per pipeline rank (interleaved_1f1b; 2 on the V of zbv, dualpipev)
    virtual_stages: int = option(1)
    # parallel.pp_layers: the blocks of each virtual stage, e.g. (3, 5); None: an even split
    layers: tuple[int, ...] | None = option(None, key="pp_layers")
    # parallel.pp_posting: how the executor hands its sends and receives to the backend (posting.py):
    # auto, the backend's own; nccl on gloo runs the GPU's posting on the CPU
    posting: str = option("auto", key="pp_posting")

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule={self.schedule!r} is not a schedule: "
                              f"choose one of {', '.join(SCHEDULES)}")
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"parallel.virtual_stages={v!r} must be an integer >= 1")
        if self.posting not in CHOICES:
            raise ConfigError(f"parallel.pp_posting={self.posting!r}: choose one of {', '.join(CHOICES)} "
                              "(auto: the backend's own posting; nccl on gloo runs the GPU's posting on the CPU)")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
