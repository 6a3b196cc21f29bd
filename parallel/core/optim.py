"""The optimizers written out: AdamW (the arithmetic of torch.optim.AdamW's single-tensor path) and
plain SGD (`train.optimizer=sgd`), each in a page, on one shared base.

Why not torch.optim.AdamW itself: it gives the same numbers (tests/unit/test_optim.py checks that
step by step), but constructing it imports torch._dynamo, about two seconds of CPU per process.
With four ranks on two cores that is most of a short test run. And the sharded strategies need
an optimizer whose state is plainly one tensor per parameter, which this is.

Plain SGD is here because the mean of several AdamW updates is not the AdamW update of the mean
gradient: DiLoCo (parallel/diloco/) reduces to data parallelism at H = 1 only with an inner
optimizer that is linear in the gradient. Its weight decay is AdamW's, decoupled: p <- p(1 - lr·wd)
before the step, on the same groups (none on biases and norms), so that `train.weight_decay`
means one thing whichever optimizer runs.
"""

from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "sgd")  # train.optimizer


class Optimizer:
    """What both optimizers share: groups of parameters with their weight decay, a step count, and
    their state per parameter by name for checkpoints. A subclass gives `begin_step` and `update`.

    `param_groups` is a list of {"params": [...], "weight_decay": float}; lr is shared by all groups.
    """

    STATE_KEYS: tuple[str, ...] = ()  # the tensors it keeps per parameter, for checkpoints

    def __init__(self, param_groups: list[dict], lr: float):
        self.param_groups = [{"params": list(g["params"]), "weight_decay": g.get("weight_decay", 0.0)}
                             for g in param_groups]
        self.lr = lr
        self.step_count = 0
        # Per parameter: its state tensors (STATE_KEYS), created lazily at the first step.
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
        self.begin_step()
        for group in self.param_groups:
            for p in group["params"]:
                self.update(p, group["weight_decay"])

    # A step in two halves, for an optimizer that steps its parameters a few at a time (ZeRO starts
    # each part's all-gather as soon as that part is stepped): once per step, then once per parameter.
    def begin_step(self) -> None:
        self.step_count += 1

    def update(self, p: torch.Tensor, decay: float) -> None:
        raise NotImplementedError

    # -- checkpoints: the state by parameter name ------------------------------------------------
    def named_state(self, named_params) -> dict:
        """{"step": steps taken, "state": {name: {key: tensor}}} for the given (name, parameter)
        pairs, copied to the CPU. Before the first step (and for plain SGD, ever) there is none."""
        return {"step": self.step_count, "state": {
            name: {k: t.detach().cpu().clone() for k, t in self.state[p].items()}
            for name, p in named_params if p in self.state}}

    def load_named_state(self, named_params, state: dict, local_part=lambda name, t: t) -> None:
        """Take the state of the given parameters from a `named_state`-shaped dict whose tensors
        may be whole where the parameters are pieces (`local_part(name, whole)` cuts this rank's).

        A parameter without state in a state that has taken steps is an error, not a silent
        restart of its moments from zero (resumed runs would drift from an uninterrupted one).
        """
        step = int(state["step"])
        missing = [name for name, _ in named_params if name not in state["state"]]
        if self.STATE_KEYS and step > 0 and missing:
            raise KeyError(f"the optimizer state has taken {step} steps but holds no Adam moments for {len(missing)} "
                           f"parameter(s), e.g. {missing[:3]}: it was saved under other names")
        self.step_count = step
        for name, p in named_params:
            moments = state["state"].get(name)
            if moments is None:
                self.state.pop(p, None)
            else:
                self.state[p] = {k: local_part(name, t).to(p.device, p.dtype).clone() for k, t in moments.items()}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (ZeRO reports it beside the formula)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())


class SGD(Optimizer):
    """Plain SGD with AdamW's decoupled weight decay: p <- p(1 - lr·wd) - lr·g. No state."""

    @torch.no_grad()
    def update(self, p: torch.Tensor, decay: float) -> None:
        if p.grad is None:
            return
        p.mul_(1 - self.lr * decay)
        p.add_(p.grad, alpha=-self.lr)


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019); betas and eps shared by all groups."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(param_groups, lr)
        self.beta1, self.beta2 = betas
        self.eps = eps

    def begin_step(self) -> None:
        super().begin_step()
        t = self.step_count
        self._bias_correction2_sqrt = math.sqrt(1 - self.beta2 ** t)
        self._step_size = self.lr / (1 - self.beta1 ** t)

    @torch.no_grad()
    def update(self, p: torch.Tensor, decay: float) -> None:
        if p.grad is None:
            return
        state = self.state.get(p)
        if state is None:
            state = self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # The same operations, in the same order, as torch.optim.adamw's single-tensor path.
        p.mul_(1 - self.lr * decay)
        m.lerp_(p.grad, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(p.grad, p.grad, value=1 - self.beta2)
        denom = (v.sqrt() / self._bias_correction2_sqrt).add_(self.eps)
        p.addcdiv_(m, denom, value=-self._step_size)
