"""The README's worked example: a new strategy is one module and one registry entry.

`dp_flat` is data parallelism with one flat all-reduce of every gradient after backward (what a
first DDP would do before buckets). A strategy of the project's own would be a module in its
family's folder and an entry in the family's `ENTRIES` (parallel/dp/__init__.py); this one lives
outside the project, so it is registered at run time, with `register`. It is written here,
registered here, and trained by the project's own entry point, `launch.train`, with no other file
of the project changed:

    torchrun --standalone --nproc-per-node 2 tests/helpers/toy_strategy.py parallel=dp parallel.name=dp_flat

tests/runs/test_registry.py runs it and checks it against the single-process run and its closed form.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code

import torch  # noqa: E402
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: E402

from parallel.dp import theory as dp_theory  # noqa: E402
from parallel.registry import register  # noqa: E402
from parallel.spec import StrategySpec  # noqa: E402
from parallel.strategy import GradSync, Strategy, make_optimizer  # noqa: E402


# -- 1. the module: a gradient sync and a strategy that uses it ----------------------------------------
class FlatAllReduce(GradSync):
    """After the last microbatch's backward, every gradient in one flat buffer, summed over dp."""

    def __init__(self, params, comm):
        super().__init__(params)
        self.comm = comm

    def finish(self) -> None:
        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        self.comm.all_reduce(flat, tag="grads/flat")
        for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)
        self.complete()


class FlatDataParallel(Strategy):
    name = "dp_flat"

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, dp_comm):
        sync = FlatAllReduce([p for p in model.parameters() if p.requires_grad], dp_comm)
        super().__init__(model, make_optimizer(model, lr, weight_decay), loss_comm=dp_comm, sync=sync)


# -- 2. the registry entry -----------------------------------------------------------------------------
register(StrategySpec(
    name="dp_flat", description="data parallel with one flat all-reduce after backward (the registry's worked example)",
    build=lambda model, plan, ctx: FlatDataParallel(model, plan.lr, plan.weight_decay, ctx.comm("dp")),
    comm=dp_theory.dp_comm,  # one all-reduce of all gradients: exactly dp's bytes
    model_state=dp_theory.replicated_model_state_bytes,
    min_world=2,
    checkpoints=False,  # to show the refusal; Strategy's defaults would in fact save and load it
))

if __name__ == "__main__":
    from launch.train import cli

    cli()
