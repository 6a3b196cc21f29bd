"""The data-parallel strategy: the whole model on every rank, gradients summed over dp.

Each rank runs its slice of the global batch; before the optimizer, the gradient sync
(parallel/sync/allreduce.py, naive or bucketed) sums the gradients over the dp group, so every rank
takes the same step.
"""

from __future__ import annotations

import torch.nn as nn

from parallel.core.optim import Optimizer
from parallel.dist.comm import Communicator
from parallel.strategy import Strategy
from parallel.sync.allreduce import make_grad_sync


class DataParallel(Strategy):
    name = "dp"

    def __init__(self, model: nn.Module, optimizer: Optimizer, dp_comm: Communicator, grad_sync: str, bucket_mb: float,
                 comm_dtype: str = "fp32"):
        sync = make_grad_sync(list(model.named_parameters()), dp_comm, grad_sync, bucket_mb, comm_dtype)
        super().__init__(model, optimizer, loss_comm=dp_comm, sync=sync)
        self.grad_sync = grad_sync

    def close(self) -> None:
        self.loss_comm.wait_all()
