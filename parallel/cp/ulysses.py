"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509).

Outside attention every rank holds its tokens (sequence-sharded). Attention needs every token of
a head but nothing of the other heads, so one all-to-all trades tokens for heads:

    (b, a, s/cp, d) on each rank  --all-to-all-->  (b, a/cp, s, d): all tokens of a/cp heads

attention runs on whole sequences of its heads, and a second all-to-all brings the output back to
(b, a, s/cp, d). Backward runs the two in reverse (the gradient of an all-to-all is the inverse
all-to-all). Q, K and V go in one all-to-all (packed along the heads: one call, the same bytes as three).

Grouped-query attention. K and V have a_kv heads, fewer than Q's a; each serves a/a_kv consecutive
query heads. The all-to-all gives rank j query heads j·a/cp .. (j+1)·a/cp − 1 and kv heads
j·a_kv/cp .. (j+1)·a_kv/cp − 1, which are exactly the ones those query heads read, so cp must
divide a_kv too. Where cp is a multiple of a_kv instead (cp 4, 2 kv heads), each kv head is
replicated cp/a_kv times before the all-to-all (as DeepSpeed's Ulysses does): cp kv heads, one per
rank, the one its query heads read; backward sums the replicas' gradients. Sizes where neither
divides the other are refused before any process group (parallel/cp/layout.py `validate`).

The ranks hold the load-balanced layout's chunks (parallel/cp/layout.py), the same as the ring,
so a strategy cuts its batch one way for both. After the all-to-all the sequence arrives in that
layout's order (rank 0's two chunks, then rank 1's, ...); one local permutation puts it in
position order, so the attention inside is the model's own AttentionCore (SDPA with is_causal),
unchanged, and a second permutation puts the output back before it leaves.

Bytes: an all-to-all of a rank's input S sends (cp − 1)/cp·S (the part addressed to itself stays
home). Per layer and microbatch, forward and backward alike: (cp − 1)/cp·b·(s/cp)·(2a + 2a')·d
elements (Q, K, V in, the output back), a' = a_kv, or cp where the kv heads are replicated.
See parallel/cp/theory.py and docs/theory/context.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.model import AttentionCore
from parallel.cp.layout import layout_order
from parallel.dist.comm import Communicator


def sequence_to_heads(comm: Communicator, x: torch.Tensor, tag: str) -> torch.Tensor:
    """(n, b, a, s/cp, d) sequence-sharded -> (n, b, a/cp, s, d) head-sharded, sequence in rank order."""
    cp = comm.size
    n, b, a, local, d = x.shape
    # Part j of dim 0 goes to rank j: head group j, all of this rank's tokens.
    parts = x.reshape(n, b, cp, a // cp, local, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    received = torch.empty_like(parts)  # part i: rank i's tokens of this rank's head group
    comm.all_to_all_single(received, parts, tag=tag)
    return received.permute(1, 2, 3, 0, 4, 5).reshape(n, b, a // cp, cp * local, d)


def heads_to_sequence(comm: Communicator, x: torch.Tensor, tag: str) -> torch.Tensor:
    """(n, b, a/cp, s, d) head-sharded, sequence in rank order -> (n, b, a, s/cp, d) sequence-sharded."""
    cp = comm.size
    n, b, heads, s, d = x.shape
    # Part i of dim 0 goes to rank i: its tokens, this rank's head group.
    parts = x.reshape(n, b, heads, cp, s // cp, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    received = torch.empty_like(parts)  # part j: rank j's head group of this rank's tokens
    comm.all_to_all_single(received, parts, tag=tag)
    return received.permute(1, 2, 0, 3, 4, 5).reshape(n, b, heads * cp, s // cp, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return sequence_to_heads(comm, x, f"{tag}/fwd")

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(ctx.comm, grad, f"{ctx.tag}/bwd"), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return heads_to_sequence(comm, x, f"{tag}/fwd")

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(ctx.comm, grad, f"{ctx.tag}/bwd"), None, None


def kv_heads_sent(kv_heads: int, cp: int) -> int:
    """K's (and V's) heads in the all-to-all: a_kv where cp divides them, else cp (each kv head
    replicated cp/a_kv times, which needs a_kv to divide cp)."""
    if kv_heads % cp == 0:
        return kv_heads
    if cp % kv_heads:
        raise ValueError(f"{kv_heads} kv heads neither divide nor are divided by cp={cp} (parallel/cp/layout.validate)")
    return cp


def pack_heads(tensors: list[torch.Tensor], cp: int) -> torch.Tensor:
    """(b, a_i, n, d) for each tensor -> (b, Σa_i, n, d) ordered rank by rank: rank j's heads of
    every tensor side by side, so that one all-to-all hands each rank its own."""
    return torch.cat([t.unflatten(1, (cp, -1)) for t in tensors], dim=2).flatten(1, 2)


class UlyssesAttentionCore(nn.Module):
    """Drop-in for the model's AttentionCore on one rank of a cp group, by all-to-all.

    q: (batch, heads, 2·c, head_dim), this rank's two chunks of the load-balanced layout; k, v the
    same with kv heads. cp must divide the heads, and divide the kv heads or be a multiple of them.
    `inner` is the attention run on whole sequences (the block's own AttentionCore, so dropout,
    SDPA and its grouped-query attention behave as without context parallelism).
    """

    def __init__(self, comm: Communicator, tag: str, inner: nn.Module | None = None):
        super().__init__()
        self.comm, self.tag = comm, tag
        self.inner = inner if inner is not None else AttentionCore()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp = self.comm.size
        if q.shape[1] % cp:
            raise ValueError(f"{q.shape[1]} heads cannot be split over cp={cp} ranks (parallel/cp/layout.validate)")
        replicas = kv_heads_sent(k.shape[1], cp) // k.shape[1]
        if replicas > 1:
            k, v = k.repeat_interleave(replicas, dim=1), v.repeat_interleave(replicas, dim=1)
        seq_len = q.shape[2] * cp
        gathered_positions = layout_order(cp, seq_len, q.device)  # position of each gathered token
        qkv = _SequenceToHeads.apply(pack_heads([q, k, v], cp).unsqueeze(0), self.comm, self.tag)[0]
        qkv = qkv.index_select(2, torch.argsort(gathered_positions))  # into position order
        q_heads, kv_heads = q.shape[1] // cp, k.shape[1] // cp
        out = self.inner(*qkv.split([q_heads, kv_heads, kv_heads], dim=1))
        out = out.index_select(2, gathered_positions)  # back into rank order
        return _HeadsToSequence.apply(out.unsqueeze(0), self.comm, self.tag)[0]
