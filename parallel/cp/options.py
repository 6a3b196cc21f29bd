"""Context parallelism's option: which attention crosses the cp ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from parallel.dist.dims import ParallelDims
from parallel.family import option
from parallel.spec import ConfigError

CP_KINDS = ("ring", "a2a")


@dataclass(frozen=True)
class CPOptions:
    FAMILY: ClassVar[str] = "cp"

    # The attention across the cp ranks: "ring" (K, V blocks passed around the ring) or "a2a" (all-to-all,
    # Ulysses). Not a config key: the entry asked for sets it (parallel=cp_a2a asks for the all-to-all
    # wherever its layout runs, the recipe 3d included).
    kind: str = option("ring", key="cp_kind", configurable=False)

    def __post_init__(self):
        if self.kind not in CP_KINDS:
            raise ConfigError(f"the cp kind {self.kind!r} is not one of {', '.join(CP_KINDS)}")

    def cut(self, dims: ParallelDims) -> dict:
        return {"cp_kind": self.kind}
