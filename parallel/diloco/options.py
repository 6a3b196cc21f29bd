"""DiLoCo's options: how many local steps between syncs, the outer optimizer, the streaming fragments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from parallel.family import option
from parallel.spec import ConfigError


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DiLoCoOptions:
    FAMILY: ClassVar[str] = "diloco"

    # parallel.inner_steps: H, the local steps each worker takes between two syncs of the same fragment
    inner_steps: int = option(1)
    # parallel.outer_lr: the outer SGD's learning rate, applied to the averaged pseudo-gradient
    outer_lr: float = option(1.0)
    # parallel.outer_momentum: the outer SGD's Nesterov momentum μ (0: plain SGD, no momentum buffer)
    outer_momentum: float = option(0.0)
    # parallel.fragments: F, contiguous groups of the model's parts, synced in turn (Streaming DiLoCo)
    fragments: int = option(1)

    def __post_init__(self):
        if not _count(self.inner_steps) or self.inner_steps < 1:
            raise ConfigError(f"parallel.inner_steps={self.inner_steps!r} must be an integer >= 1 "
                              "(1: sync after every step), e.g. parallel.inner_steps=10")
        if not _number(self.outer_lr) or self.outer_lr <= 0:
            raise ConfigError(f"parallel.outer_lr={self.outer_lr!r} must be a positive number: "
                              "e.g. parallel.outer_lr=0.7 (DiLoCo's), or 1 for plain averaging")
        if not _number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"parallel.outer_momentum={self.outer_momentum!r} must be in [0, 1): "
                              "e.g. parallel.outer_momentum=0.9 (DiLoCo's Nesterov), or 0 for none")
        if not _count(self.fragments) or self.fragments < 1:
            raise ConfigError(f"parallel.fragments={self.fragments!r} must be an integer >= 1 "
                              "(1: the whole model at once; more: Streaming DiLoCo)")
        object.__setattr__(self, "outer_lr", float(self.outer_lr))
        object.__setattr__(self, "outer_momentum", float(self.outer_momentum))
