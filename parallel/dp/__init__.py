"""Data parallelism: every rank holds the whole model and takes its slice of the batch.

  strategy.py   the strategy `dp`: the model, an optimizer and one of the all-reduce syncs
                (parallel/sync/allreduce.py: naive, or DDP's buckets) over the dp group
  rules.py      its refusals (the sync's name), checked by run_plan.py before any process group
  theory.py     its closed forms: traffic 2(n − 1)/n·Ψ·4 per step, the replicated model state

The entry `dp` is below; derivations in docs/theory/data-parallel.md.
"""

from __future__ import annotations

from parallel import algebra
from parallel.activations import registry_activations
from parallel.dp import theory
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions


def _build_dp(model, plan, ctx):
    from parallel.dp.strategy import DataParallel
    from parallel.strategy import plan_optimizer

    sync = plan.layout.of(SyncOptions)
    return DataParallel(model, plan_optimizer(model, plan), ctx.comm("dp"), sync.grad_sync,
                        sync.bucket_mb, sync.comm_dtype)


ENTRIES = (
    StrategySpec(
        name="dp", description="data parallel, hand-written: gradients all-reduced over dp (naive, or bucketed as DDP)",
        build=_build_dp, comm=theory.dp_comm, model_state=theory.replicated_model_state_bytes,
        local_parameters=algebra.tp_local_parameter_count,
        honours={"sync": ("grad_sync", "bucket_mb", "zero", "comm_dtype")},
        counterpart="torch_ddp",
        moe=True, activations=registry_activations, recompute=True, tied_head=True, sgd=True,
    ),
)
