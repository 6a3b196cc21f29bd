"""The refusals that span two families, checked after each family's own: where they meet, here.

A family's rules read only its own options (parallel/<family>/rules.py); these read two:

  sync x pp    the bucketed all-reduce against virtual stages (ZeRO's reductions take a pipeline as
               it comes: ZeRO-2 reduces each part when its gradients are in, parallel/sync/zero.py)
"""

from __future__ import annotations

from parallel.family import Check
from parallel.pp import rules as pp_rules
from parallel.pp.options import PPOptions
from parallel.sync.options import SyncOptions


def rules_across_families(check: Check) -> None:
    spec, layout = check.spec, check.layout
    if not spec.uses(PPOptions):
        return
    pipeline, sync = layout.of(PPOptions), layout.of(SyncOptions)
    if not spec.honours_option(SyncOptions, "grad_sync"):
        return
    if not sync.zero:  # the ZeroOptimizer replaces grad_sync
        pp_rules.check_pipeline_grad_sync(check.dims, sync.grad_sync, pipeline.virtual_stages, pipeline.schedule)
