"""Attention one block at a time: a block of queries against a block of keys, and how blocks merge.

Ring attention never holds a row's keys all at once, so it cannot take one softmax over the row.
It computes each (query block, key block) pair on its own, keeping with the block's output the
row's log-sum-exp over that block's keys,

    S = Q·Kᵀ·scale (+ mask)     lse = log Σ_j exp(S_j)     O = exp(S − lse)·V

and merges blocks with the online-softmax identity (Milakov & Gimelshein 2018, arXiv 1805.02867;
FlashAttention, Dao et al. 2022, arXiv 2205.14135): for two blocks of keys of one row,

    lse = log(exp(lse₁) + exp(lse₂))     O = exp(lse₁ − lse)·O₁ + exp(lse₂ − lse)·O₂

which is the softmax over both blocks exactly. `torch.logsumexp` and `torch.logaddexp` subtract
the running row maximum before exponentiating, so nothing overflows.

The backward of one block needs only the row's *final* lse and D = rowsum(dO ⊙ O) (FlashAttention-2,
Dao 2023, arXiv 2307.08691, Algorithm 2): with P = exp(S − lse), the softmax over all the keys,

    dV = Pᵀ·dO     dP = dO·Vᵀ     dS = P ⊙ (dP − D)     dQ = dS·K·scale     dK = dSᵀ·Q·scale

and the gradients of all blocks simply add up. Everything here runs in the dtype it is given
(ring.py gives fp32, or float64 for float64 activations).

Grouped-query attention. K and V may have fewer heads than Q: each kv head serves g = heads /
kv heads consecutive query heads. The queries come grouped, (..., kv heads, g, n, d), and K, V
as they are, (..., kv heads, n, d): one kv head's matrix meets its g query heads by broadcasting,
so no copy of K or V per query head is ever made (the ring sends them unexpanded, which is GQA's
saving). Backward, a kv head's dK and dV are the sums over its g query heads, since every one of
them read it. With g = 1 this is multi-head attention.

Block kinds. With the sequence cut into chunks, a query chunk a and a key chunk b under the
causal mask are one of: FULL (a > b: every query is after every key), CAUSAL (a == b: the
diagonal, lower triangle) or EMPTY (a < b: nothing to compute).
"""

from __future__ import annotations

import torch

FULL, CAUSAL, EMPTY = "full", "causal", "empty"


def block_kind(query_chunk: int, key_chunk: int) -> str:
    if query_chunk > key_chunk:
        return FULL
    return CAUSAL if query_chunk == key_chunk else EMPTY


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """(..., g, n, n) scores of grouped queries q (..., g, n, d) on keys k (..., n, d)."""
    scores = torch.matmul(q, k.unsqueeze(-3).transpose(-2, -1)) * scale
    if causal:  # a diagonal block: query i of the chunk sees keys 0..i of the same chunk
        n = scores.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of grouped queries q (..., g, n, d) against keys k and values v (..., n, d):
    out (..., g, n, d), lse (..., g, n)."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.unsqueeze(-3)), lse


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over the union of two blocks of keys, from each block's (out, lse)."""
    new_lse = torch.logaddexp(lse, block_lse)
    new_out = torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return new_out, new_lse


def block_backward(q, k, v, dout, lse, delta, causal: bool, scale: float):
    """This block's share of (dQ, dK, dV), given the row's final `lse` and `delta` = rowsum(dO ⊙ O);
    shapes as `block_forward`'s: dQ grouped like q, dK and dV summed over each kv head's g queries."""
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    dv = torch.matmul(probs.transpose(-2, -1), dout).sum(-3)
    dscores = probs * (torch.matmul(dout, v.unsqueeze(-3).transpose(-2, -1)) - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k.unsqueeze(-3)) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), q).sum(-3) * scale
    return dq, dk, dv
