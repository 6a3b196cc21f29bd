"""Rotary position embedding (RoPE; Su et al. 2021, as Llama uses it).

Each head's dimensions are cut into pairs, and the pair (x_i, x_{i+d/2}) of the token at position p
is rotated by the angle p·θ_i, θ_i = base^(-2i/d): the "rotate half" pairing of GPT-NeoX and
Hugging Face's Llama. After the rotation the dot product of a query at position p and a key at
position p' depends on p - p' only, so attention sees relative positions with no parameters.

Two things follow for the strategies:
  - the rotation is per token, so it reads the token's *global* position: context parallelism,
    whose rank holds two chunks of the sequence, gives `Rotary.positions` its rank's positions
    (parallel/cp/transform.py), as it does the learned table's;
  - a rotation is orthogonal, so its backward is the rotation by the opposite angle, and the angles
    are a function of the positions alone: `_Rotate` saves nothing for backward (no copy of Q or
    K, not even the (s, d) cosine and sine tables) and computes the angles again in backward from
    the same `positions`, as fused RoPE kernels do from their frequency table. What attention
    saves of q and k is the rotated pair the core reads (parallel/activations.py counts those).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.positions import sequence_positions


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dimension's halves: multiplying by i in each pair's plane."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _Rotate(torch.autograd.Function):
    """(q, k) -> (q·cos + rotate_half(q)·sin, the same for k); backward rotates each gradient back,
    g·cos - rotate_half(g·sin), with cos and sin computed again (`rotary.tables`), not saved."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, rotary: Rotary):
        cos, sin = rotary.tables(q)
        ctx.rotary = rotary  # the module, not a tensor: its angles are recomputed from the positions
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos, sin = ctx.rotary.tables(grad_q)
        # The transpose of x -> rotate_half(x) is x -> -rotate_half(x).
        return grad_q * cos - rotate_half(grad_q * sin), grad_k * cos - rotate_half(grad_k * sin), None


class Rotary(nn.Module):
    """Rotates q (b, heads, s, d) and k (b, kv heads, s, d) by their tokens' positions.

    `positions(length, device)` gives the global positions of the `length` tokens this rank's
    attention sees (the whole sequence here; a context-parallel rank's own chunks after
    parallel/cp/transform.py), like the learned embedding's.
    """

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.head_dim, self.base = head_dim, float(base)
        self.positions = sequence_positions

    def angles(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of p·θ_i, (length, d), each frequency written twice (once per half), in fp32."""
        d = self.head_dim
        inverse = self.base ** -(torch.arange(0, d, 2, device=device, dtype=torch.float64) / d)
        angle = self.positions(length, device).to(torch.float64)[:, None] * inverse[None, :]
        angle = torch.cat((angle, angle), dim=-1)
        return angle.cos().float(), angle.sin().float()

    def tables(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a (..., length, d) tensor, in its dtype: under bf16 autocast q and k are
        bf16, rotated in their dtype as the projections left them."""
        cos, sin = self.angles(like.shape[-2], like.device)
        return cos.to(like.dtype), sin.to(like.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _Rotate.apply(q, k, self)
