"""Rotary position embedding (RoPE; Su et al. 2021, as Llama uses it).

Each head's dimensions are cut into pairs, and the pair (x_i, x_{i+d/2}) of the token at position p
is rotated by the angle p·θ_i, θ_i = base^(-2i/d): the "rotate half" pairing of GPT-NeoX and
Hugging Face's Llama. After the rotation the dot product of a query at position p and a key at
position p' depends on p - p' only, so attention sees relative positions with no parameters.

Two things follow for the strategies:
  - the rotation is per token, so it reads the token's *global* position: context parallelism,
    whose rank holds two chunks of the sequence, gives `Rotary.positions` its rank's positions
    (parallel/cp/transform.py), as it does the learned table's;
  - a rotation is orthogonal, so its backward is the rotation by the opposite angle: `_Rotate`
    saves only the angles' cosines and sines (one (s, d) table each, shared by Q and K) and no
    copy of Q or K, which is what parallel/activations.py counts.
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
    """y = x·cos + rotate_half(x)·sin; backward rotates the gradient back: g·cos - rotate_half(g·sin)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        # The transpose of x -> rotate_half(x) is x -> -rotate_half(x).
        return grad * cos - rotate_half(grad * sin), None, None


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

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.angles(q.shape[-2], q.device)
        # Under bf16 autocast q and k are bf16: rotate in their dtype, as the projections left them.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return _Rotate.apply(q, cos, sin), _Rotate.apply(k, cos, sin)
