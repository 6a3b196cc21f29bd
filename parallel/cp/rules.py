"""Context parallelism's refusals, checked by plan.py before any process group (parallel.cp > 1).

The sequence must cut into 2·cp chunks (and each rank's tokens into tp pieces under sequence
parallelism), the all-to-all needs the heads to divide, and a mixture of experts is refused
(`check_context_parallel` of parallel/cp/strategy.py, with parallel/cp/layout.py's `validate`).
"""

from __future__ import annotations

from parallel.core.model import GPTConfig
from parallel.dist.dims import ParallelDims
from parallel.spec import ConfigError, Options


def check_context_parallel(model: GPTConfig, dims: ParallelDims, options: Options) -> None:
    """Sequence length, heads and model kind against the cp layout (parallel/cp/strategy.py)."""
    if dims.cp == 1:
        return
    from parallel.cp.strategy import check_context_parallel as check  # torch: only where cp is asked for

    try:
        check(model, dims.cp, dims.tp, options.cp_kind, options.sequence_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None
