"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509).

Outside attention every rank holds its tokens (sequence-sharded). Attention needs every token of
a head but nothing of the other heads, so one all-to-all trades tokens for heads:

    (b, a, s/cp, d) on each rank  --all-to-all-->  (b, a/cp, s, d): all tokens of a/cp heads

attention runs on whole sequences of its heads, and a second all-to-all brings the output back to
(b, a, s/cp, d). Backward runs the two in reverse (the gradient of an all-to-all is the inverse
all-to-all). Q, K and V go in one all-to-all (stacked: one call, the same bytes as three).

The ranks hold the load-balanced layout's chunks (parallel/cp/layout.py), the same as the ring,
so a strategy cuts its batch one way for both. After the all-to-all the sequence arrives in that
layout's order (rank 0's two chunks, then rank 1's, ...); one local permutation puts it in
position order, so the attention inside is the model's own AttentionCore (SDPA with is_causal),
unchanged, and a second permutation puts the output back before it leaves.

Bytes: an all-to-all of a rank's input S sends (cp − 1)/cp·S (the part addressed to itself stays
home). Per layer and microbatch, forward and backward alike: (cp − 1)/cp·4·b·(s/cp)·a·d elements
(Q, K, V in, the output back). See parallel/cp/theory.py and docs/theory/context.md.
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


class UlyssesAttentionCore(nn.Module):
    """Drop-in for the model's AttentionCore on one rank of a cp group, by all-to-all.

    q, k, v: (batch, heads, 2·c, head_dim), this rank's two chunks of the load-balanced layout;
    heads must be divisible by cp. `inner` is the attention run on whole sequences (the block's
    own AttentionCore, so dropout and SDPA behave as without context parallelism).
    """

    def __init__(self, comm: Communicator, tag: str, inner: nn.Module | None = None):
        super().__init__()
        self.comm, self.tag = comm, tag
        self.inner = inner if inner is not None else AttentionCore()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp = self.comm.size
        if q.shape[1] % cp:
            raise ValueError(f"{q.shape[1]} heads cannot be split over cp={cp} ranks (parallel/cp/layout.validate)")
        seq_len = q.shape[2] * cp
        gathered_positions = layout_order(cp, seq_len, q.device)  # position of each gathered token
        qkv = _SequenceToHeads.apply(torch.stack((q, k, v)), self.comm, self.tag)
        qkv = qkv.index_select(3, torch.argsort(gathered_positions))  # into position order
        out = self.inner(qkv[0], qkv[1], qkv[2]).index_select(2, gathered_positions)  # back into rank order
        return _HeadsToSequence.apply(out.unsqueeze(0), self.comm, self.tag)[0]
