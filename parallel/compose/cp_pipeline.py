"""Context parallelism in front of a pipeline: the recipe's piece where the cp and pp families meet.

The pipeline runner (parallel/pp/executor.py) is fed with this cp rank's tokens only, cut the way
the cp strategy cuts them (parallel/cp/strategy.py `shard_batch`), so cp composes with tensor and
pipeline parallelism on one mesh (parallel/compose/combined.py) without either family knowing the other.
"""

from __future__ import annotations

import torch

from parallel.core.data import Batch
from parallel.cp.strategy import shard_batch
from parallel.dist.comm import Communicator
from parallel.pp.executor import PipelineParallel


class ContextParallelPipeline(PipelineParallel):
    """The pipeline runner fed with this cp rank's tokens: the first stage embeds them, the last
    computes their loss, and every stage boundary carries b·(s/cp)·h (or b·(s/cp/t)·h under
    sequence parallelism), since the shapes follow the microbatch."""

    def __init__(self, chunks, *, cp_comm: Communicator, **runner):
        super().__init__(chunks, **runner)
        self.cp_comm = cp_comm

    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        rank, cp = self.cp_comm.rank, self.cp_comm.size
        return super().train_step([shard_batch(mb, rank, cp) for mb in microbatches], global_tokens)

    def close(self) -> None:
        super().close()
        self.cp_comm.wait_all()
