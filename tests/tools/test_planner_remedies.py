"""The planner on the three remedies for slow links (docs/theory/planner.md, "Remedies"): hybrid sharding
(hsdp, hsdp_zero2, torch_hsdp), low-precision collectives (parallel.comm_dtype) and DiLoCo (parallel=diloco).
Without training: the bytes per group and per link class against the families' closed forms, exactly; where
each group's ranks sit (the shard group inside a node, the replicate group across); the time rules on a
synthetic cluster worked out by hand; memory against the registry's model state.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from parallel.dist.dims import ParallelDims
from parallel.planner.links import group_span
from parallel.planner.timing import BUCKET_BYTES, _dp_exposed
from parallel.planner.traffic import GroupTraffic


# -- the time rules, on traffic given by hand ----------------------------------------------------------------
def _group(name: str, total: float, gathers: float = 0, size: int = 4, every: int = 1) -> GroupTraffic:
    span = group_span(ParallelDims(size, size), "dp", size, "ring")
    return GroupTraffic(name, Fraction(total), Fraction(gathers), span, every, after_step=every > 1)


def test_the_data_parallel_groups_share_one_backward_window_and_a_periodic_sync_hides_nowhere():
    """HSDP's shard and replicate reductions follow one another in the same backward: their sum, not each
    alone, is set against it. A sync every H steps (DiLoCo's outer all-reduce) is exposed whole."""
    world, per_rank = 4, 1e8
    shard = _group("dp_shard", 2 * per_rank * world, gathers=per_rank * world)
    replicate = _group("dp_replicate", per_rank / 2 * world)
    seconds = {"dp_shard": 0.8, "dp_replicate": 0.2}  # the shard group's: half gathers, half reduce-scatters
    traffic = {"dp_shard": shard, "dp_replicate": replicate}
    # Reductions 0.4 + 0.2 s against a 0.3 s backward: 0.3 s shows, plus the 0.4 s of gathers.
    assert _dp_exposed(traffic, seconds, 3, None, 0.3, world) == pytest.approx(0.4 + 0.3)
    # A long backward hides them but for the last bucket of the larger: 25 MiB of its 100 MB per rank.
    last = 0.4 * BUCKET_BYTES / per_rank
    assert _dp_exposed(traffic, seconds, 3, None, 10.0, world) == pytest.approx(0.4 + last)
    outer = {"dp": _group("dp", per_rank, every=10)}
    assert _dp_exposed(outer, {"dp": 0.03}, 0, "bucketed", 10.0, world) == pytest.approx(0.03)
