"""The expert-parallel strategy (`parallel=ep`): experts sharded over ep ranks, inside data parallelism.

The world is d data-parallel ranks, each with its slice of the global batch; every n = parallel.ep
consecutive dp ranks form an expert-parallel group that shares one copy of the experts, rank j of
the group holding experts [j·E/n, (j+1)·E/n) of every MoE block (parallel/moe/expert_parallel.py:
the tokens travel to their experts and back by all-to-all, forward and backward). The d/n ranks
that hold the same experts form an `edp` group (parallel/dist/dims.py). What is summed where:

* the dense parts and the routers (every rank holds them whole, and has its tokens' share of
  their gradient): over all d dp ranks, as `parallel=dp` does (bucketed or naive);
* the experts: over edp only. Within an ep group an expert lives on one rank and its gradient is
  already complete for the group's tokens after backward (every token routed to it came to it);
  the other ep groups hold copies of the same expert, trained on other tokens;
* the loss for the log: over dp (each rank's share includes its sequences' balancing loss).

dp 4 x ep 2 therefore all-reduces the dense gradients over 4 ranks and each expert's over 2; with
ep = dp the experts are never all-reduced at all (edp has one rank).

Checkpoints are layout-free: the whole model is gathered to rank 0 (its own dense parts, every ep
rank's experts, over the ep group) under single-process names; loading keeps the experts this rank
holds.
"""

from __future__ import annotations

import torch

from parallel.core.model import GPT
from parallel.dist.comm import Communicator
from parallel.moe.expert_parallel import shard_experts
from parallel.strategy import GradSync, Strategy, make_optimizer
from parallel.sync.allreduce import make_grad_sync


class GroupedGradSync(GradSync):
    """Several gradient syncs, each over its own parameters and group, run as one: every moment of
    the step (zero_grad, before_microbatch, finish) goes to each in turn. The parameter sets are
    disjoint, so the order between them does not matter; every rank runs them in the same order."""

    def __init__(self, syncs: list[GradSync]):
        super().__init__([p for sync in syncs for p in sync.params])
        self.syncs = syncs

    def zero_grad(self) -> None:
        for sync in self.syncs:
            sync.zero_grad()

    def before_microbatch(self, last: bool) -> None:
        for sync in self.syncs:
            sync.before_microbatch(last)

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()
        self.complete()


class ExpertParallel(Strategy):
    name = "ep"

    def __init__(self, model: GPT, dp_comm: Communicator, ep_comm: Communicator, edp_comm: Communicator | None,
                 grad_sync: str, bucket_mb: float, lr: float, weight_decay: float):
        self._full_parameters = sum(p.numel() for p in model.parameters())
        self.ep_comm, self.edp_comm = ep_comm, edp_comm
        self.expert_names = set(shard_experts(model, ep_comm))
        named = list(model.named_parameters())
        dense = [(n, p) for n, p in named if n not in self.expert_names]
        experts = [(n, p) for n, p in named if n in self.expert_names]
        sync = GroupedGradSync([make_grad_sync(dense, dp_comm, grad_sync, bucket_mb),
                                make_grad_sync(experts, edp_comm, grad_sync, bucket_mb)])
        super().__init__(model, make_optimizer(model, lr, weight_decay), loss_comm=dp_comm, sync=sync)

    def full_parameter_count(self) -> int:
        return self._full_parameters

    # -- the whole model, for checkpoints and tests: every ep rank's experts gathered to ep rank 0 ----
    def _with_group_experts(self, local: dict, tag: str) -> dict:
        """`local` (this rank's entries by single-process name) with the experts of every rank of the
        ep group added (collective over ep; complete on ep rank 0, which global rank 0 is)."""
        gathered = self.ep_comm.gather_object({n: v for n, v in local.items() if self._is_expert(n)}, 0, tag=tag)
        merged = dict(local)
        for part in gathered or []:
            merged.update(part)
        return merged

    def _is_expert(self, name: str) -> bool:
        return name.split("/", 1)[0] in self.expert_names  # a moment `name/exp_avg` goes with its parameter

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        local = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return self._with_group_experts(local, "tooling/state")

    def full_optimizer_state(self) -> dict:
        local = self.optimizer.named_state(self.named_full_parameters())
        return {"step": local["step"], "state": self._with_group_experts(local["state"], "tooling/optim_state")}

    def full_grads(self) -> dict:
        local = {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()}
        return {"grads": self._with_group_experts(local, "tooling/full_grads"), "tp_replica_max_diff": {}}

    def close(self) -> None:
        for comm in (self.loss_comm, self.ep_comm, self.edp_comm):
            if comm is not None:
                comm.wait_all()

