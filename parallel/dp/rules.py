"""Data parallelism's refusals, checked by run_plan.py before any process group.

The layout rules that every data-parallel entry shares (world size, the dimensions it splits along)
are the registry's, read from the entries' fields (parallel/registry.py); what is left here is the
gradient sync's own option.
"""

from __future__ import annotations

from parallel.spec import ConfigError
from parallel.sync.allreduce import GRAD_SYNCS


def check_grad_sync(grad_sync) -> None:
    """parallel.grad_sync names one of the syncs of parallel/sync/allreduce.py."""
    if grad_sync not in GRAD_SYNCS:
        raise ConfigError(f"parallel.grad_sync={grad_sync!r}: choose one of {', '.join(GRAD_SYNCS)}")
