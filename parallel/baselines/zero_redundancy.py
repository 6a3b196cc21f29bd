"""PyTorch's own ZeRO-1: DDP plus `torch.distributed.optim.ZeroRedundancyOptimizer`, the baseline for `zero1`.

What PyTorch calls ZeRO-1 differs from the paper's (and our `zero1`) in two places, both visible
in the communication log:

* the gradients are all-reduced whole by DDP (its buckets, our comm hook as for torch_ddp), not
  reduce-scattered: every rank has every summed gradient, and steps only its own parameters';
* ownership is by whole parameters (largest first, each to the rank that owns the fewest elements
  so far), not by equal flat shards, and after the step each rank broadcasts the parameters it owns.

The broadcasts are PyTorch's `_broadcast_params_from_rank`, the one entry point of its parameter
sync: the subclass below sends the same broadcasts through the project's communicator, so they are
counted like every other byte. The optimizer inside is the project's AdamW on this rank's
parameters (the same arithmetic on every element as the single run).
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from parallel.baselines.ddp import TorchDDP
from parallel.core.optim import AdamW
from parallel.dist.comm import Communicator
from parallel.strategy import storage_bytes


class CountedZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose parameter broadcasts go through the communication log."""

    def __init__(self, param_groups, comm: Communicator, **defaults):
        self.comm = comm
        super().__init__(param_groups, optimizer_class=AdamW, process_group=comm.group, **defaults)

    def _broadcast_params_from_rank(self, rank: int):
        # What torch's version does with parameters_as_bucket_view=False (its default): one async
        # broadcast of each parameter rank `rank` owns, from that rank.
        return [self.comm.broadcast(p.data, src_group_rank=rank, tag=f"zero1/param_broadcast/from{rank}",
                                    async_op=True)
                for group in self._partition_parameters()[rank] for p in group["params"]]

    @property
    def local(self) -> AdamW:
        return self.optim  # this rank's AdamW: the moments of the parameters it owns


def zero_redundancy_optimizer(model: torch.nn.Module, comm: Communicator, lr: float,
                              weight_decay: float) -> CountedZeroRedundancyOptimizer:
    """The weight-decay groups of strategy.make_optimizer, sharded by ZeroRedundancyOptimizer."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return CountedZeroRedundancyOptimizer(groups, comm, lr=lr, betas=(0.9, 0.95), eps=1e-8)


class TorchZero1(TorchDDP):
    """DDP (the bare baseline, comm hook and all) with ZeroRedundancyOptimizer as its optimizer."""

    name = "torch_zero1"

    def __init__(self, model, dp_comm: Communicator, bucket_mb: float, lr: float, weight_decay: float):
        super().__init__(model, lambda module: zero_redundancy_optimizer(module, dp_comm, lr, weight_decay),
                         dp_comm, bucket_mb)
        self.comm = dp_comm
        self.owner = self.optimizer._param_to_rank  # parameter -> the dp rank that steps it

    def memory_report(self) -> dict:
        params = list(self.model.module.parameters())
        state = storage_bytes(t for s in self.optimizer.local.state.values() for t in s.values())
        grads = storage_bytes(p.grad for p in params)
        weights = storage_bytes(params)
        return {"param_bytes": weights, "grad_bytes": grads, "optimizer_bytes": state,
                "peak_model_state_bytes": weights + grads + state}

    # -- checkpoints: each parameter's moments live on its owner; they are broadcast from there ------
    def full_optimizer_state(self) -> dict:
        local, state = self.optimizer.local, {}
        if local.step_count == 0:
            return {"step": 0, "state": {}}  # no moments before the first step, as AdamW.named_state
        for name, p in self.named_full_parameters():
            owner = self.owner[p]
            mine = local.state.get(p) if owner == self.comm.rank else None
            for key in ("exp_avg", "exp_avg_sq"):
                t = mine[key].clone() if mine is not None else torch.zeros_like(p)
                self.comm.broadcast(t, src_group_rank=owner, tag=f"tooling/checkpoint/{key}")
                state.setdefault(name, {})[key] = t.detach().cpu()
        return {"step": local.step_count, "state": state}

    @torch.no_grad()
    def load_full_state(self, model_state: dict, optim_state: dict) -> None:
        named = list(self.named_full_parameters())
        for name, p in named:
            p.copy_(model_state[name])
        # Every rank keeps the moments of the parameters it owns (no communication).
        mine = [(name, p) for name, p in named if self.owner[p] == self.comm.rank]
        self.optimizer.local.load_named_state(mine, optim_state)
