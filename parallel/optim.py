"""AdamW written out: the arithmetic of torch.optim.AdamW (single-tensor path), in a page.

Why not torch.optim.AdamW itself: it gives the same numbers (tests/test_optim.py checks that
step by step), but constructing it imports torch._dynamo, about two seconds of CPU per process.
With four ranks on two cores that is most of a short test run. And the sharded strategies need
an optimizer whose state is plainly one tensor per parameter, which this is.
"""

from __future__ import annotations

import math

import torch


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019).

    `param_groups` is a list of {"params": [...], "weight_decay": float}; lr, betas and eps are
    shared by all groups.
    """

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.param_groups = [{"params": list(g["params"]), "weight_decay": g.get("weight_decay", 0.0)} for g in param_groups]
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.step_count = 0
        # Per parameter: first and second moment, created lazily at the first step.
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def parameters(self):
        for group in self.param_groups:
            yield from group["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        t = self.step_count
        bias_correction1 = 1 - self.beta1 ** t
        bias_correction2_sqrt = math.sqrt(1 - self.beta2 ** t)
        step_size = self.lr / bias_correction1
        for group in self.param_groups:
            decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if state is None:
                    state = self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                m, v = state["exp_avg"], state["exp_avg_sq"]
                # The same operations, in the same order, as torch.optim.adamw's single-tensor path.
                p.mul_(1 - self.lr * decay)
                m.lerp_(p.grad, 1 - self.beta1)
                v.mul_(self.beta2).addcmul_(p.grad, p.grad, value=1 - self.beta2)
                denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
                p.addcdiv_(m, denom, value=-step_size)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (ZeRO reports it beside the formula)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())
