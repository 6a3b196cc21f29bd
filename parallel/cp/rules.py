"""Context parallelism's refusals, checked by the run validator before any process group (parallel.cp > 1).

The sequence must cut into 2·cp chunks (and each rank's tokens into tp pieces under sequence
parallelism), the all-to-all needs the heads to divide, and a mixture of experts is refused
(`check_context_parallel` of parallel/cp/strategy.py, with parallel/cp/layout.py's `validate`).
"""

from __future__ import annotations

from parallel.family import Check
from parallel.spec import ConfigError


def cp_rules(check: Check) -> None:
    """Sequence length, heads and model kind against the cp layout (parallel/cp/strategy.py); the
    kind of attention and the tp pieces of each rank's tokens as the layout cuts its microbatch."""
    dims = check.dims
    if dims.cp == 1:
        return
    from parallel.cp.strategy import check_context_parallel  # torch: only where cp is asked for

    cut = check.layout.cut()
    try:
        check_context_parallel(check.model, dims.cp, dims.tp, cut.cp_kind, cut.sequence_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None
