"""RMSNorm that saves for backward what a fused kernel saves: its input and 1/rms per token.

    y = x / rms(x) · w,    rms(x) = sqrt(mean over the h features of x² + eps)

(Zhang & Sennrich 2019: LayerNorm without the centring and the bias.) torch's nn.RMSNorm runs this
on the CPU as a chain of ops (pow, mean, rsqrt, mul, mul), and each op saves what its own backward
needs: the input, 1/rms, the normalized x/rms and, for the linear after it, the output. The
normalized tensor is a second copy of the input's size that backward could rebuild from the
input and 1/rms. Fused kernels (apex's FusedRMSNorm, Transformer Engine's, torch's own CUDA
`_fused_rms_norm`) keep only the input and the fp32 1/rms, and rebuild the rest in backward:

    x̂ = x · r,  r = 1/rms(x)         ∂L/∂w = Σ over tokens of g · x̂
                                      ∂L/∂x = r · (g·w − x̂ · mean over features of (g·w · x̂))

`RMSNorm` here is nn.RMSNorm (same parameter, same state-dict key, same numbers: the forward runs
the same ops in the same order) whose forward is one autograd Function saving exactly those two
tensors, n·h·B + n·4 bytes for n tokens, which is what parallel/activations.py counts for it.
LayerNorm stays torch's: its kernel already saves its input, mean and 1/std.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _reduced_dims(x: torch.Tensor, normalized: int) -> tuple[int, ...]:
    return tuple(range(x.dim() - normalized, x.dim()))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit inputs (as torch's kernels accumulate), the input's own dtype otherwise."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class _RMSNorm(torch.autograd.Function):
    """y = (x · r · w) in x's dtype, r = rsqrt(mean(x²) + eps) computed in fp32 for 16-bit x; saves x and r."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, normalized: int, eps: float) -> torch.Tensor:
        dims = _reduced_dims(x, normalized)
        wide = x.to(_compute_dtype(x))
        rstd = torch.rsqrt(wide.pow(2).mean(dims, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized = normalized
        return (wide * rstd * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dims = _reduced_dims(x, ctx.normalized)
        wide_x = x.to(rstd.dtype)
        normalized = wide_x * rstd
        # The weight's gradient sums over every token (all dimensions before the normalized ones).
        token_dims = tuple(range(x.dim() - ctx.normalized))
        wide_grad = grad.to(rstd.dtype)
        grad_weight = (wide_grad * normalized).sum(token_dims).to(weight.dtype)
        scaled = wide_grad * weight.to(rstd.dtype)
        grad_x = rstd * (scaled - normalized * (scaled * normalized).mean(dims, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """F.rms_norm's signature and numbers, saving only x and the fp32 1/rms: what every module that
    normalizes with an RMSNorm's parameters calls (this one's forward, tensor parallelism's norm)."""
    if weight is None:
        raise ValueError("RMSNorm here always has a weight (elementwise_affine=True), as Llama's does")
    eps = eps if eps is not None else torch.finfo(x.dtype).eps
    return _RMSNorm.apply(x, weight, len(normalized_shape), eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (with a weight) whose saved tensors are its input and the fp32 1/rms per token."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)
