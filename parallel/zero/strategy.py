"""`zero1` and `zero2`: the whole model on every rank, the optimizer a ZeroOptimizer over dp."""

from __future__ import annotations

import torch.nn as nn

from parallel.dist.comm import Communicator
from parallel.strategy import Strategy
from parallel.sync.pieces import zero_pieces
from parallel.sync.zero import ZeroOptimizer


class ZeroDataParallel(Strategy):
    """The ZeroOptimizer is both the gradient sync and the optimizer."""

    def __init__(self, model: nn.Module, dp_comm: Communicator, stage: int, lr: float, weight_decay: float,
                 comm_dtype: str = "fp32"):
        self.zero = ZeroOptimizer(list(model.named_parameters()), dp_comm, stage, lr, weight_decay, comm_dtype)
        super().__init__(model, self.zero, loss_comm=dp_comm, sync=self.zero)
        self.name = f"zero{stage}"

    def memory_report(self) -> dict:
        return self.zero.memory()

    def full_grads(self) -> dict:
        return {"grads": self.zero.synced_grads(), "tp_replica_max_diff": {}}

    def full_optimizer_state(self) -> dict:
        return self.zero.full_optimizer_state()

    def checkpoint_pieces(self):
        """Parameters are whole on every rank; each still writes only its shard's range of them."""
        zero = self.zero
        return zero_pieces(zero.parts, [flat[part.lo: part.hi] for part, flat in zip(zero.parts, zero.flat_params)],
                           zero.optimizer)

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        self.zero.load_full_state(model_state, optim_state)

    def close(self) -> None:
        self.zero.comm.wait_all()
