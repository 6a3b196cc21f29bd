"""Which rank holds which virtual stage: a property of the schedule.

The model is cut into p·v consecutive pieces, the virtual stages 0 .. p·v-1; rank r holds v of
them, its local chunks 0 .. v-1. Two placements are in use:

* loop (Megatron's interleaved layout; with v = 1 simply stage r on rank r): chunk c of rank r is
  virtual stage c·p + r. A microbatch loops over the ranks v times, 0 -> 1 -> ... -> p-1 -> 0 ...;
  every boundary vs -> vs+1 crosses ranks (when p > 1): v·p - 1 crossings in each direction.
* v (ZB-V, Qi et al. 2023, arXiv 2401.10241 §6; DualPipeV, DeepSeek-V3 report §3.2.1): two chunks
  per rank, chunk 0 of rank r is virtual stage r and chunk 1 is virtual stage 2p-1-r. Stages
  0..p-1 run down ranks 0..p-1 and stages p..2p-1 come back up ranks p-1..0, so the last stage
  (and the loss) sits on rank 0 beside the embedding, and the turn p-1 -> p stays inside rank p-1:
  2(p-1) crossings in each direction instead of 2p-1.

A boundary inside one rank sends nothing: the chunk hands its output (and, backward, its input
gradient) to the rank's other chunk directly.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOP, V = "loop", "v"


@dataclass(frozen=True)
class Placement:
    stages: int          # p pipeline ranks
    virtual: int = 1     # v chunks per rank
    shape: str = LOOP

    def __post_init__(self) -> None:
        if self.shape not in (LOOP, V):
            raise ValueError(f"placement shape {self.shape!r}: choose {LOOP!r} or {V!r}")
        if self.shape == V and self.virtual != 2:
            raise ValueError(f"the V placement holds exactly 2 chunks per rank, not virtual={self.virtual}")

    @property
    def vstages(self) -> int:
        return self.stages * self.virtual

    def vstage(self, rank: int, chunk: int) -> int:
        """(rank, local chunk) -> virtual stage."""
        if self.shape == V:
            return rank if chunk == 0 else 2 * self.stages - 1 - rank
        return chunk * self.stages + rank

    def location(self, vstage: int) -> tuple[int, int]:
        """Virtual stage -> (rank, local chunk)."""
        if self.shape == V:
            return (vstage, 0) if vstage < self.stages else (2 * self.stages - 1 - vstage, 1)
        return vstage % self.stages, vstage // self.stages

    def rank_of(self, vstage: int) -> int:
        return self.location(vstage)[0]

    def vstages_of(self, rank: int) -> list[int]:
        """The virtual stages rank `rank` holds, by local chunk."""
        return [self.vstage(rank, c) for c in range(self.virtual)]

    def crosses(self, vstage: int) -> bool:
        """Whether the boundary vstage -> vstage+1 joins two different ranks (and so sends bytes)."""
        return self.rank_of(vstage) != self.rank_of(vstage + 1)

    def crossings(self) -> int:
        """Boundaries between ranks, in each direction: v·p-1 for loop (p > 1), 2(p-1) for v."""
        return sum(self.crosses(vs) for vs in range(self.vstages - 1))
