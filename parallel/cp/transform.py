"""Turn the one GPT into this rank's context-parallel model, in place.

Context parallelism shards activations, not weights: every rank keeps every parameter and runs
every layer on its own tokens (the two chunks of parallel/cp/layout.py). Only two things see the
sequence as a whole and change:
  - positions: the learned embedding must add each token's global position, and rotary positions
    (parallel/core/rotary.py) must rotate each token's q and k by it, not by arange(local length):
    both read the rank's chunk positions (`RankPositions`), so that a query and a key on different
    ranks still meet at their true distance;
  - the attention core, the one place where tokens meet tokens: it becomes a ring or an all-to-all.
Everything else (norms, projections, MLP, head, the summed token loss) is per token and runs
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

KINDS = ("ring", "a2a")


class RankPositions:
    """The global positions of cp rank `rank`'s tokens (its two chunks, parallel/cp/layout.py): set
    as the embedding's `positions` (parallel/core/model.py `Embedding`), whichever embedding the
    model has (tensor parallelism's takes its own piece of these under sequence parallelism), and
    as every block's rotary `positions`, which sees this rank's whole 2·c tokens."""

    def __init__(self, rank: int, cp: int):
        self.rank, self.cp = rank, cp

    def __call__(self, length: int, device) -> torch.Tensor:
        return rank_positions(self.rank, self.cp, length * self.cp, device=device)


def attention_core(kind: str, comm: Communicator, tag: str, original: nn.Module) -> nn.Module:
    """The core that replaces `original` (the block's AttentionCore): tagged `tag` in the log."""
    if kind == "ring":
        return RingAttentionCore(comm, tag)
    if kind == "a2a":
        return UlyssesAttentionCore(comm, tag, inner=original)
    raise ValueError(f"context-parallel kind {kind!r} is not one of {', '.join(KINDS)}")


def parallelize_cp(model: GPT, comm: Communicator, kind: str) -> None:
    """Give the embedding and every block's rotary positions this rank's positions and replace
    every block's attention core (tagged `cp/blocks.<i>.attn`). After tensor parallelism
    (`parallelize_tp` first), the cores see this tp rank's heads only."""
    positions = RankPositions(comm.rank, comm.size)
    model.embed.positions = positions
    for i, block in enumerate(model.blocks):
        if block.attn.rotary is not None:
            block.attn.rotary.positions = positions
        block.attn.core = attention_core(kind, comm, f"cp/blocks.{i}.attn", block.attn.core)
