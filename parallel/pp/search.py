"""What the planner may try of pipeline parallelism's options on a layout.

Where the entry is pipelined over more than one stage: every schedule asked for (conf/plan.yaml's
plan.search.schedules; by default every registered schedule whose bubble has a closed form), each
with every chunk count it runs (plan.search.virtual_stages; by default 1 up to the layers per
stage, L / p), each with a balanced uneven split where the layers do not divide into the pieces;
the defaults elsewhere.
"""

from __future__ import annotations

from functools import lru_cache

from parallel.family import Search
from parallel.pp.options import PPOptions
from parallel.pp.schedules import SCHEDULES, ScheduleError, built_schedule


def pp_search(search: Search) -> list[PPOptions]:
    if not (search.spec.uses(PPOptions) and search.dims.pp > 1):
        return [PPOptions()]
    space, pp, n_layers = search.space, search.dims.pp, search.model.n_layers
    schedules = space.get("schedules") or [s.name for s in SCHEDULES.values() if s.idle is not None]
    chunks = space.get("virtual_stages") or range(1, n_layers // pp + 1)
    out = []
    for schedule in schedules:
        for v in chunks:
            if pp * v > n_layers or not runs_chunks(schedule, v):
                continue
            layers = balanced_layers(n_layers, pp * v) if space.get("uneven_stages", True) else None
            out.append(PPOptions(schedule=schedule, virtual_stages=v, layers=layers))
    return out


@lru_cache(maxsize=4096)
def runs_chunks(schedule: str, v: int) -> bool:
    """Whether the schedule runs v chunks per rank, asked of its builder at the smallest pipeline (2
    stages, 2 microbatches): every registered schedule decides its chunk count before reading p or m
    (gpipe, 1f1b and zbh1 run 1, zbv and dualpipev 2, interleaved_1f1b any), so a count refused here
    is refused at every size, and run_plan.py is not asked about it for each one."""
    try:
        built_schedule(schedule, 2, 2, v)
    except ScheduleError:
        return False
    return True


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
