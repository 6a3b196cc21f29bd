"""The tensor-parallel strategy, composed with data parallelism (world = dp x tp).

Each tp group holds one copy of the model, sharded by `parallelize_tp`; the dp groups hold
copies of the same shard and sum their gradients exactly as `parallel=dp` does (bucketed or
naive, over the dp communicator only). What is summed where:

* activations and their gradients: over tp, inside forward and backward (parallel/tp.py);
* sequence-sharded gradients (sequence parallelism only: LayerNorms, row-parallel biases, the
  position table): over tp, once per step after backward;
* every local gradient, shards included: over dp, once per step;
* the loss for the log: over dp only. The vocab-parallel loss is already the full loss of this
  dp slice on every tp rank; summing it over tp too would count it t times (torchtitan #3280).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .comm import Communicator
from .data import Batch
from .dp import make_grad_sync
from .tp import all_gather_along, parallelize_tp, sum_sequence_partial_grads
from .tp_loss import vocab_parallel_loss_sum
from .strategy import Strategy

GATHER_TAG = "tooling/gather_params"


class TensorParallel(Strategy):
    name = "tp"

    def __init__(self, model: nn.Module, optimizer_factory, tp_comm: Communicator, dp_comm: Communicator,
                 sequence_parallel: bool, grad_sync: str, bucket_mb: float):
        self.tp_comm = tp_comm
        self.sequence_parallel = sequence_parallel
        self.shards = parallelize_tp(model, tp_comm, sequence_parallel)
        super().__init__(model, optimizer_factory(model), loss_comm=dp_comm)
        params = dict(model.named_parameters())
        self.sequence_partial = [params[n] for n in self.shards.sequence_partial]
        self.sync = make_grad_sync(model, dp_comm, grad_sync, bucket_mb) if dp_comm.size > 1 else None

    def zero_grad(self) -> None:
        if self.sync is not None:
            self.sync.zero_grad(self.optimizer)
        else:
            super().zero_grad()

    def backward_context(self, last_microbatch: bool):
        if self.sync is not None:
            self.sync.arm(last_microbatch)
        return contextlib.nullcontext()

    def forward_loss(self, mb: Batch, global_tokens: int) -> torch.Tensor:
        local_logits = self.model(mb.inputs)
        return vocab_parallel_loss_sum(local_logits, mb.targets, self.shards.vocab_start, self.tp_comm) / global_tokens

    def after_backward(self) -> None:
        if self.sync is not None:
            self.sync.finish()
        # Sums over tp and over dp commute, so the sequence-sharded gradients are summed over tp
        # after the dp sync has finished: the bucketed sync's all-reduces are in flight during
        # backward, and summing a gradient while its bucket is on the wire would race it.
        sum_sequence_partial_grads(self.sequence_partial, self.tp_comm)

    # -- the whole model, for checkpoints and tests ----------------------------------------------
    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            dim = self.shards.split_dim.get(name)
            full = all_gather_along(self.tp_comm, t.detach(), dim, GATHER_TAG) if dim is not None else t.detach()
            out[name] = full.cpu().clone()
        return out

    def full_parameter_count(self) -> int:
        t = self.tp_comm.size
        return sum(p.numel() * (t if n in self.shards.split_dim else 1) for n, p in self.model.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather(dict(self.model.named_parameters()))

    def full_optimizer_state(self) -> dict:
        """Adam's moments are shaped like the parameters: gather them along the same dims."""
        params = dict(self.model.named_parameters())
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            gathered = self._gather({n: self.optimizer.state[p][key] for n, p in params.items() if p in self.optimizer.state})
            for name, full in gathered.items():
                moments.setdefault(name, {})[key] = full
        return {"step": self.optimizer.step_count, "state": moments}

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The slice `parallelize_tp` gave this rank: equal consecutive pieces along the split dim."""
        dim = self.shards.split_dim.get(name)
        if dim is None:
            return full
        size = full.shape[dim] // self.tp_comm.size
        return full.narrow(dim, self.tp_comm.rank * size, size)

    def full_grads(self) -> dict:
        grads = self._gather({n: p.grad for n, p in self.model.named_parameters()})
        # Replicated gradients must be complete and equal on every tp rank, or the replicas drift
        # apart; the spread across ranks is reported so a test can prove it is zero.
        spread = {}
        for name, p in self.model.named_parameters():
            if name not in self.shards.split_dim:
                copies = all_gather_along(self.tp_comm, p.grad.detach().unsqueeze(0), 0, GATHER_TAG)
                spread[name] = float((copies - copies[0]).abs().max())
        return {"grads": grads, "tp_replica_max_diff": spread}

    def close(self) -> None:
        self.tp_comm.wait_all()
        self.loss_comm.wait_all()
