"""The refusals that span two families, checked after each family's own: where they meet, here.

A family's rules read only its own options (parallel/<family>/rules.py); these read two:

  tp x pp      the saved sequence piece with a schedule that splits each backward in two halves,
               both of which would gather it again (tp's message)
  sync x pp    ZeRO-2 inside a pipeline (its per-microbatch reduce-scatters need final gradients:
               no sequence-parallel partial sums, no chunks whose backwards run apart), and the
               bucketed all-reduce against virtual stages
"""

from __future__ import annotations

from parallel.dist.dims import LayoutError
from parallel.family import Check
from parallel.pp import rules as pp_rules
from parallel.pp.options import PPOptions
from parallel.pp.schedules import schedule_splits_backward
from parallel.sync.options import SyncOptions
from parallel.tp.options import TPOptions
from parallel.tp.rules import SAVES_WITH_SPLIT_BACKWARD
from parallel.zero import rules as zero_rules


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
    if sync.zero:  # the ZeroOptimizer replaces grad_sync
        zero_rules.check_zero_in_pipeline(sync.zero, layout.of(TPOptions).sequence_parallel, pipeline.virtual_stages,
                                          pipeline.schedule, pp_rules.v_shaped(pipeline.schedule))
    else:
        pp_rules.check_pipeline_grad_sync(check.dims, sync.grad_sync, pipeline.virtual_stages, pipeline.schedule)
