"""What the planner may try of pipeline parallelism's options on a layout.

Every schedule and chunk count asked for (conf/plan.yaml's plan.search) where the entry is pipelined
over more than one stage, each with a balanced uneven split where the layers do not divide into the
stages; the defaults elsewhere.
"""

from __future__ import annotations

from functools import lru_cache

from parallel.family import Search
from parallel.pp.options import PPOptions
from parallel.pp.schedules import SCHEDULES, built_schedule


def pp_search(search: Search) -> list[PPOptions]:
    if not (search.spec.uses(PPOptions) and search.dims.pp > 1):
        return [PPOptions()]
    space, pp = search.space, search.dims.pp
    out = []
    for schedule in space.get("schedules", tuple(SCHEDULES)):  # those registered by then
        for v in space.get("virtual_stages", (1, 2, 4)):
            layers = balanced_layers(search.model.n_layers, pp * v) if space.get("uneven_stages", True) else None
            out.append(PPOptions(schedule=schedule, virtual_stages=v, layers=layers))
    return out


def balanced_layers(n_layers: int, pieces: int) -> list[int] | None:
    """An uneven split for parallel.pp_layers: every piece floor(L/pieces) blocks, the remainder one
    more each on the middle pieces (the first holds the embedding, the last the head)."""
    if pieces > n_layers or n_layers % pieces == 0:
        return None
    base, extra = divmod(n_layers, pieces)
    order = sorted(range(pieces), key=lambda i: (i in (0, pieces - 1), abs(i - (pieces - 1) / 2)))
    counts = [base] * pieces
    for i in order[:extra]:
        counts[i] += 1
    return counts


@lru_cache(maxsize=4096)
def schedule_identity(schedule: str, p: int, m: int, v: int) -> int:
    """The identity of the action lists a schedule gives (interleaved with one chunk is 1F1B's)."""
    return hash(built_schedule(schedule, p, m, v))
