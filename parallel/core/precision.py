"""Numeric precision of the forward pass: fp32, or bf16 autocast over fp32 master weights.

fp32 (the default) is what every correctness test uses: the 1e-5 comparisons with the single run
only hold when nothing is rounded to 16 bits. bf16 runs the matrix multiplies of the forward pass
in bfloat16 through `torch.autocast` on the run's device, while the parameters, their gradients
and the optimizer state stay fp32 (the "master weights"): autocast casts a copy of each weight for
the multiply, and the gradient flows back through the cast into the fp32 parameter. bf16 has
fp32's exponent range, so no loss scaling is needed (fp16 would need a GradScaler).

Only the forward pass (and the loss) runs under autocast, as PyTorch recommends; backward ops
run in the dtype their forward op used. The losses are computed in fp32 either way
(`token_loss_sum` and the vocab-parallel loss upcast the logits).
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16")


class ForwardContext:
    """A factory of the context the forward pass runs in (a fresh one per microbatch), counting
    how often it was entered: a strategy that ran its forward without it would silently train in
    fp32 under train.precision=bf16, and the training loop refuses that after the first step."""

    def __init__(self, precision: str, device: torch.device):
        if precision not in PRECISIONS:
            # run_plan.py refuses it first
            raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.device_type = device.type
        self.entered = 0

    def __call__(self) -> contextlib.AbstractContextManager:
        self.entered += 1
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
