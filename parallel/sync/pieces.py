"""What a rank holds of the single-process model, as pieces: the unit of a sharded checkpoint.

A sharded strategy holds, of each tensor of the single-process model, one contiguous run of its
elements in flattened (row-major) order: ZeRO's flat shards cut parameters wherever a shard
boundary falls (parallel/sync/shards.py), FSDP2's dim-0 chunks are a run of whole rows. A `Piece`
names that run by the tensor's single-process key, so that pieces written under one layout fill
whole tensors under any other (parallel/reliability/sharded.py writes and reads them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Piece:
    """One contiguous run of a single-process tensor's flattened elements."""

    key: str  # model/<name> or optim/<name>/<moment>, as a gathered checkpoint names it
    shape: tuple[int, ...]  # the whole tensor's
    offset: int  # index of values[0] in the whole tensor, flattened
    values: torch.Tensor  # 1-D


@dataclass
class RankState:
    """What one rank saves: its pieces, the optimizer's step count, tied names (alias -> name)."""

    pieces: list[Piece]
    optimizer_step: int
    aliases: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(p.values.numel() * p.values.element_size() for p in self.pieces)

    def host_copy(self) -> RankState:
        """The same pieces copied to fresh host memory, so training may change the originals."""
        pieces = [Piece(p.key, p.shape, p.offset, p.values.detach().to("cpu", copy=True)) for p in self.pieces]
        return RankState(pieces, self.optimizer_step, dict(self.aliases))


def model_key(name: str) -> str:
    return f"model/{name}"


def moment_key(name: str, moment: str) -> str:
    return f"optim/{name}/{moment}"


def flat_shard_pieces(part, shard: torch.Tensor, key) -> list[Piece]:
    """The pieces of a ZeRO part's flat shard (elements [part.lo, part.hi) of the part's padded
    flat buffer) that fall inside parameters; `key(name)` names them. The padding is not saved."""
    out = []
    for name, p, start in zip(part.names, part.params, part.offsets):
        lo, hi = max(part.lo, start), min(part.hi, start + p.numel())
        if lo < hi:
            out.append(Piece(key(name), tuple(p.shape), lo - start, shard[lo - part.lo: hi - part.lo]))
    return out


def zero_pieces(parts, param_shards: list[torch.Tensor], optimizer) -> RankState:
    """A ZeRO rank's part: its shard of every part's parameters and of both Adam moments."""
    pieces = []
    for index, (part, shard) in enumerate(zip(parts, param_shards)):
        pieces += flat_shard_pieces(part, shard, model_key)
        for moment in ("exp_avg", "exp_avg_sq"):
            pieces += flat_shard_pieces(part, optimizer.shard_state(index, moment),
                                        lambda name, m=moment: moment_key(name, m))
    return RankState(pieces, int(optimizer.step_count))


def row_chunk_piece(key: str, shape: tuple[int, ...], local: torch.Tensor, rank: int, world: int) -> list[Piece]:
    """A dim-0 chunk as torch.chunk cuts it (ceil(d0/N) rows per rank; the last ranks fewer, or
    none) as a piece: rows are contiguous in row-major order."""
    if local.numel() == 0:
        return []
    rows = -(-shape[0] // world)
    row_numel = math.prod(shape[1:])
    return [Piece(key, tuple(shape), rank * rows * row_numel, local.reshape(-1))]


def first_replica_only(state: RankState, replica_rank: int) -> RankState:
    """`state` on the first of the ranks that hold the same pieces (HSDP's replicate group), none on
    the others: a sharded checkpoint must cover every tensor exactly once."""
    return state if replica_rank == 0 else RankState([], state.optimizer_step, dict(state.aliases))
