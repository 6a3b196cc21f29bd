"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025): H local steps, then an outer step.

Every worker (a dp rank) holds the whole model and trains it alone on its slice of each global
batch, with its own inner optimizer (AdamW or SGD; its state is never synced). It also holds the
outer parameters θ, the model as all workers last agreed on it. After every H inner steps:

    Δ  = mean over workers of (θ − θ_local)     the pseudo-gradient: one all-reduce, 2(N-1)/N·Ψ·B
    m  = μ·m + Δ;   θ = θ − η·(Δ + μ·m)          the outer Nesterov SGD (η = parallel.outer_lr)
    θ_local = θ                                 every worker restarts from the agreed model

Streaming DiLoCo does the same fragment by fragment (parallel/diloco/schedule.py: fragment f at its
own offset in each period of H), so each sync moves Ψ_f, about Ψ/F, and a link's peak falls by F.

Each worker's loss is the mean over its own tokens (the paper's: a worker trains as if alone), so
its pseudo-gradient is that of its own batch and their mean is dp's step: with H = 1, η = 1, μ = 0
and a plain SGD inner optimizer, θ − θ_local = lr·g_local and the mean is lr·g, dp's update
(docs/diloco.md). The outer parameters are what the run saves (`full_state_dict`): the model the
workers agreed on, not any one worker's drift since.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.optim import Optimizer
from parallel.diloco.options import DiLoCoOptions
from parallel.diloco.schedule import fragment_parts, syncing
from parallel.dist.comm import Communicator
from parallel.strategy import Strategy, storage_bytes


def model_parts(model: nn.Module) -> list[nn.Module]:
    """The GPT's parts in forward order, as parallel/algebra.py's `part_parameter_counts` counts them."""
    return [model.embed, *model.blocks, model.head]


class DiLoCo(Strategy):
    name = "diloco"

    def __init__(self, model: nn.Module, optimizer: Optimizer, dp_comm: Communicator, options: DiLoCoOptions):
        super().__init__(model, optimizer, loss_comm=dp_comm)  # the default GradSync: gradients stay local
        self.comm, self.options, self.workers = dp_comm, options, dp_comm.size
        parts = model_parts(model)
        self.fragments = [[p for i in run for p in parts[i].parameters()]
                          for run in fragment_parts(len(parts), options.fragments)]
        with torch.no_grad():
            self.outer = {p: p.detach().clone() for p in model.parameters()}
            self.momentum = ({p: torch.zeros_like(p) for p in model.parameters()}
                             if options.outer_momentum > 0 else {})

    def forward_loss(self, mb, global_tokens: int) -> torch.Tensor:
        """The mean over this worker's own tokens (its share of the global batch's)."""
        return super().forward_loss(mb, global_tokens // self.workers)

    def train_step(self, microbatches, global_tokens: int) -> torch.Tensor:
        """The inner step (the base class's, without a gradient sync), then the outer step of
        every fragment whose turn it is; returns this worker's share of the global mean loss."""
        local_loss = super().train_step(microbatches, global_tokens)
        for f in syncing(self.optimizer.step_count, self.options.inner_steps, self.options.fragments):
            self.outer_step(f)
        return local_loss / self.workers

    @torch.no_grad()
    def outer_step(self, fragment: int) -> None:
        params = self.fragments[fragment]
        self.phases("sync", f"outer all-reduce, fragment {fragment}")
        # The pseudo-gradient, pre-scaled by 1/N (gloo has no AVG), in one flat buffer per fragment.
        delta = torch.cat([(self.outer[p] - p).reshape(-1) for p in params]).div_(self.workers)
        self.comm.all_reduce(delta, tag=f"diloco/fragment{fragment}")
        self.phases("optimizer", f"outer step, fragment {fragment}")
        lr, mu, start = self.options.outer_lr, self.options.outer_momentum, 0
        for p in params:
            d = delta[start: start + p.numel()].view_as(p)
            start += p.numel()
            if mu > 0:  # Nesterov, as torch.optim.SGD(nesterov=True, dampening=0)
                m = self.momentum[p].mul_(mu).add_(d)
                d = d.add(m, alpha=mu)
            self.outer[p].add_(d, alpha=-lr)
            p.copy_(self.outer[p])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The outer parameters (the model the workers last agreed on), with the model's buffers."""
        state = super().full_state_dict()
        for name, p in self.model.named_parameters():
            state[name] = self.outer[p].detach().cpu().clone()
        return state

    def memory_report(self) -> dict:
        """The base class's, with the outer copy and momentum counted as optimizer state."""
        report = super().memory_report()
        outer = storage_bytes([*self.outer.values(), *self.momentum.values()])
        report["optimizer_bytes"] += outer
        report["peak_model_state_bytes"] += outer
        return report

    def close(self) -> None:
        self.loss_comm.wait_all()
