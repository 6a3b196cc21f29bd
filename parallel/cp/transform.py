"""Turn the one GPT into this rank's context-parallel model, in place.

Context parallelism shards activations, not weights: every rank keeps every parameter and runs
every layer on its own tokens (the two chunks of parallel/cp/layout.py). Only two things see the
sequence as a whole and change:
  - the position embedding, which must add each token's global position, not arange(local length);
  - the attention core, the one place where tokens meet tokens: it becomes a ring or an all-to-all.
Everything else (LayerNorms, projections, MLP, head, the summed token loss) is per token and runs
unchanged. Each rank's parameter gradients then cover only its tokens: the strategy sums them over
the cp group (with dp, over dp x cp), as data parallelism sums over its batch shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.model import GPT
from parallel.cp.layout import rank_positions
from parallel.cp.ring import RingAttentionCore
from parallel.cp.ulysses import UlyssesAttentionCore
from parallel.dist.comm import Communicator
from parallel.tp.layers import ParallelEmbedding
from parallel.tp.regions import exit_region

KINDS = ("ring", "a2a")


class ContextParallelEmbedding(nn.Module):
    """The model's token plus position embedding for this rank's tokens (the very same parameters)."""

    def __init__(self, embed: nn.Module, rank: int, cp: int):
        super().__init__()
        self.tok, self.pos, self.drop = embed.tok, embed.pos, embed.drop
        self.rank, self.cp = rank, cp

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = rank_positions(self.rank, self.cp, idx.shape[1] * self.cp, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class ContextParallelTPEmbedding(nn.Module):
    """Tensor parallelism's embedding (parallel/tp/layers.py `ParallelEmbedding`: vocab-parallel
    tokens summed over tp) with this cp rank's global positions; under sequence parallelism, tp
    rank i adds the positions of its i-th piece of this rank's tokens. The same parameters."""

    def __init__(self, embed: ParallelEmbedding, rank: int, cp: int):
        super().__init__()
        self.tok, self.pos, self.drop = embed.tok, embed.pos, embed.drop
        self.comm, self.sequence_parallel = embed.comm, embed.sequence_parallel
        self.rank, self.cp = rank, cp

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = exit_region(self.tok(idx), self.comm, "tp/embed", self.sequence_parallel)
        positions = rank_positions(self.rank, self.cp, idx.shape[1] * self.cp, device=idx.device)
        if self.sequence_parallel:
            positions = positions.chunk(self.comm.size)[self.comm.rank]
        return self.drop(x + self.pos(positions))


def attention_core(kind: str, comm: Communicator, tag: str, original: nn.Module) -> nn.Module:
    """The core that replaces `original` (the block's AttentionCore): tagged `tag` in the log."""
    if kind == "ring":
        return RingAttentionCore(comm, tag)
    if kind == "a2a":
        return UlyssesAttentionCore(comm, tag, inner=original)
    raise ValueError(f"context-parallel kind {kind!r} is not one of {', '.join(KINDS)}")


def parallelize_cp(model: GPT, comm: Communicator, kind: str) -> None:
    """Replace the embedding and every block's attention core; the tags are `cp/blocks.<i>.attn`.
    After tensor parallelism (`parallelize_tp` first), the cores see this tp rank's heads only."""
    if isinstance(model.embed, ParallelEmbedding):
        model.embed = ContextParallelTPEmbedding(model.embed, comm.rank, comm.size)
    else:
        model.embed = ContextParallelEmbedding(model.embed, comm.rank, comm.size)
    for i, block in enumerate(model.blocks):
        block.attn.core = attention_core(kind, comm, f"cp/blocks.{i}.attn", block.attn.core)
