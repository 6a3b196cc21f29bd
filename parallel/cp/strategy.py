"""The context-parallel strategies `cp` (ring attention) and `cp_a2a` (all-to-all): world = dp x cp.

The mesh is (pp, dp, cp, tp) = (1, dp, cp, 1). The cp ranks of one dp slice take the same
sequences (the dp slice of the global batch, as data parallelism gives it) and each keeps only its
two chunks of every sequence (parallel/cp/layout.py), inputs and targets alike. Every rank holds the
whole model; `parallelize_cp` replaces the position embedding (global positions) and every block's
attention core (the ring or the all-to-all), which is where the cp ranks talk.

The loss contract is the project's: each rank's loss is the cross-entropy summed over *its* tokens
divided by the global batch's token count, so the shares add up over cp and dp to the global mean
and the parameter gradients add up to the single-process gradient. Every parameter is replicated
over the d·cp ranks of the "dp_cp" group, and that is the group its gradients are summed over:
the usual gradient syncs (parallel/sync/allreduce.py, naive or bucketed) or, with parallel.zero = 1 or 2,
a ZeroOptimizer that shards over those d·cp ranks.

Per rank per step, in bytes (parallel/cp/theory.py `cp_comm`, docs/theory/context.md):
    attention  L·m·(fwd + bwd) of parallel/cp/theory.py, fwd twice under recomputation
    gradients  2(n − 1)/n·Ψ·4 all-reduced over n = d·cp ranks (ZeRO: (n − 1)/n·(G + P))

With tensor and pipeline parallelism on one mesh the same cut of the batch stands in front of the
pipeline runner (parallel/compose/cp_pipeline.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.data import Batch
from parallel.core.model import GPTConfig, token_loss_sum
from parallel.core.shape import ModelShape
from parallel.cp.layout import shard_sequence, validate
from parallel.cp.transform import parallelize_cp
from parallel.dist.comm import Communicator
from parallel.strategy import Strategy, make_optimizer
from parallel.sync.allreduce import make_grad_sync
from parallel.sync.zero import ZeroOptimizer


def shard_batch(mb: Batch, rank: int, cp: int) -> Batch:
    """This cp rank's tokens of every sequence of a microbatch: its two chunks of the inputs and
    of the targets (so each token keeps its own next-token target)."""
    return Batch(shard_sequence(mb.inputs, rank, cp), shard_sequence(mb.targets, rank, cp))


def check_context_parallel(model: GPTConfig, cp: int, tp: int, kind: str, sequence_parallel: bool) -> None:
    """Refuse, before any process group, a model the cp layout cannot cut (raises ValueError, one line)."""
    if model.moe_experts:
        raise ValueError(
            f"model.moe_experts={model.moe_experts} with parallel.cp={cp}: experts have a capacity per sequence, and "
            "a cp rank routes only its s/cp tokens of each sequence, so tokens would be dropped differently than in "
            "the unsplit model; use a dense model (model.moe_experts=0) or parallel.cp=1"
        )
    kv_heads = ModelShape(gpt=model).kv_heads_per_rank(tp)
    validate(kind, cp, model.seq_len, model.n_heads // tp, model.dropout, kv_heads=kv_heads)
    if sequence_parallel and (model.seq_len // cp) % tp:
        raise ValueError(
            f"model.seq_len={model.seq_len} / parallel.cp={cp} = {model.seq_len // cp} tokens per cp rank do not split "
            f"into parallel.tp={tp} sequence-parallel pieces: use a seq_len that is a multiple of {2 * cp * tp}, or "
            "parallel.sequence_parallel=false"
        )


class ContextParallel(Strategy):
    name = "cp"

    def __init__(self, model: nn.Module, cp_comm: Communicator, grad_comm: Communicator, kind: str, *,
                 grad_sync: str, bucket_mb: float, zero: int, lr: float, weight_decay: float):
        self.cp_comm = cp_comm
        self.kind = kind
        parallelize_cp(model, cp_comm, kind)
        named = list(model.named_parameters())
        self.zero = ZeroOptimizer(named, grad_comm, zero, lr, weight_decay) if zero else None
        if self.zero is not None:
            sync = optimizer = self.zero
        else:
            sync = make_grad_sync(named, grad_comm, grad_sync, bucket_mb)
            optimizer = make_optimizer(model, lr, weight_decay)
        super().__init__(model, optimizer, loss_comm=grad_comm, sync=sync)
        self.name = "cp" if kind == "ring" else "cp_a2a"

    def forward_loss(self, mb: Batch, global_tokens: int) -> torch.Tensor:
        local = shard_batch(mb, self.cp_comm.rank, self.cp_comm.size)
        return token_loss_sum(self.model(local.inputs), local.targets) / global_tokens

    # -- under ZeRO the optimizer holds shards: as parallel/zero/strategy.py ---------------------
    def memory_report(self) -> dict:
        return self.zero.memory() if self.zero is not None else super().memory_report()

    def full_grads(self) -> dict:
        if self.zero is None:
            return super().full_grads()
        return {"grads": self.zero.synced_grads(), "tp_replica_max_diff": {}}

    def full_optimizer_state(self) -> dict:
        return self.zero.full_optimizer_state() if self.zero is not None else super().full_optimizer_state()

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        if self.zero is not None:
            self.zero.load_full_state(model_state, optim_state)
        else:
            super().load_full_state(model_state, optim_state)

    def close(self) -> None:
        self.cp_comm.wait_all()
        self.loss_comm.wait_all()
