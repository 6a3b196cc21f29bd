"""The refusals that span two families, checked after each family's own: where they meet, here.

A family's rules read only its own options (parallel/<family>/rules.py); these read two:

  tp x pp      the saved sequence piece with a schedule that splits each backward in two halves,
               both of which would gather it again (tp's message)
  sync x pp    the bucketed all-reduce against virtual stages (ZeRO's reductions take a pipeline as
               it comes: ZeRO-2 reduces each part when its gradients are in, parallel/sync/zero.py)
"""

from __future__ import annotations

from parallel.dist.dims import LayoutError
from parallel.family import Check
from parallel.pp import rules as pp_rules
from parallel.pp.options import PPOptions
from parallel.pp.schedules import schedule_splits_backward
from parallel.sync.options import SyncOptions
from parallel.tp.rules import SAVES_WITH_SPLIT_BACKWARD


def rules_across_families(check: Check) -> None:
    spec, layout = check.spec, check.layout
    if not spec.uses(PPOptions):
        return
    pipeline, sync = layout.of(PPOptions), layout.of(SyncOptions)
    if layout.cut().saves_shard and schedule_splits_backward(pipeline.schedule, check.dims.pp, layout.microbatches,
                                                             pipeline.virtual_stages):
        raise LayoutError(SAVES_WITH_SPLIT_BACKWARD)
    if not spec.honours_option(SyncOptions, "grad_sync"):
        return
    if not sync.zero:  # the ZeroOptimizer replaces grad_sync
        pp_rules.check_pipeline_grad_sync(check.dims, sync.grad_sync, pipeline.virtual_stages, pipeline.schedule)
