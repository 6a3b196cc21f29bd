"""The tensor-parallel strategy, composed with data parallelism (world = dp x tp).

Each tp group holds one copy of the model, sharded by `parallelize_tp`; the dp groups hold
copies of the same shard and sum their gradients exactly as `parallel=dp` does (bucketed or
naive, over the dp communicator only). What is summed where:

* activations and their gradients: over tp, inside forward and backward (parallel/tp/regions.py;
  with parallel.tp_saves=sharded each region's input is all-gathered once more in backward);
* sequence-sharded gradients (sequence parallelism only: norms, row-parallel biases, the
  position table): over tp, once per step, as a completion of the dp sync (GradSync.completions);
  so are the K/V gradients where tp exceeds the kv heads (each replica holds its query heads' part);
* every local gradient, shards included: over dp, once per step;
* the loss for the log: over dp only. The vocab-parallel loss is already the full loss of this
  dp slice on every tp rank; summing it over tp too would count it t times (a bug torchtitan
  shipped once, issue #3280).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.data import Batch
from parallel.core.model import tied_aliases
from parallel.dist.comm import Communicator
from parallel.strategy import Strategy, flat_moments, moment_param, nest_moments
from parallel.sync.allreduce import make_grad_sync
from parallel.sync.options import SyncOptions
from parallel.tp.layers import parallelize_tp
from parallel.tp.loss import vocab_parallel_loss_sum
from parallel.tp.options import TPOptions
from parallel.tp.shards import tp_grad_completions


class TensorParallel(Strategy):
    name = "tp"

    def __init__(self, model: nn.Module, optimizer_factory, tp_comm: Communicator, dp_comm: Communicator,
                 options: TPOptions, dp_sync: SyncOptions):
        self.tp_comm = tp_comm
        self.sequence_parallel = options.sequence_parallel
        self.shards = parallelize_tp(model, tp_comm, options)
        sync = make_grad_sync(list(model.named_parameters()), dp_comm, dp_sync.grad_sync, dp_sync.bucket_mb)
        sync.completions += tp_grad_completions(self.shards, dict(model.named_parameters()))
        super().__init__(model, optimizer_factory(model), loss_comm=dp_comm, sync=sync)

    def forward_loss(self, mb: Batch, global_tokens: int) -> torch.Tensor:
        local_logits = self.model(mb.inputs)
        return vocab_parallel_loss_sum(local_logits, mb.targets, self.shards.vocab_start, self.tp_comm) / global_tokens

    # -- the whole model, for checkpoints and tests: pieces gathered over tp ----------------------
    def full_parameter_count(self) -> int:
        return sum(self.shards.full_numel(n, p) for n, p in self.model.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.shards.gather(dict(self.model.named_parameters()))
        # A tied head under both names, as the single-process model's state_dict has it.
        return {**state, **{alias: state[name] for alias, name in tied_aliases(self.model).items()}}

    def full_optimizer_state(self) -> dict:
        """Adam's moments are shaped like the parameters: gather them along the same dims."""
        local = self.optimizer.named_state(self.model.named_parameters())
        return {"step": local["step"],
                "state": nest_moments(self.shards.gather(flat_moments(local["state"]), moment_param))}

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return self.shards.local_part(name, full)

    def full_grads(self) -> dict:
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        return {"grads": self.shards.gather(grads), "tp_replica_max_diff": self.shards.replica_spread(grads)}

    def close(self) -> None:
        self.tp_comm.wait_all()
        self.loss_comm.wait_all()

