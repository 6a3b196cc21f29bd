"""What the planner may try of tensor parallelism's options on a layout.

Sequence parallelism where the entry honours it over tp > 1 ranks, and under it the saved sequence
piece where tp's own rule takes it for this entry and layout; nothing at all on a tp size the model
cannot be cut over (for a head count with few divisors, most of a large world's sizes), so the
planner never builds a request that the run validator would refuse for it.
"""

from __future__ import annotations

from dataclasses import replace

from parallel.dist.dims import LayoutError
from parallel.family import Search
from parallel.tp.options import TP_SAVES, TPOptions
from parallel.tp.rules import check_tp_saves, tp_cut_refusal


def tp_search(search: Search) -> list[TPOptions]:
    spec, dims, model = search.spec, search.dims, search.model
    cuts = model is not None and spec.uses(TPOptions) and dims.tp > 1
    if cuts and tp_cut_refusal(model, dims.tp, False):
        return []
    choices = tuple(search.space.get("sequence_parallel", (False, True)))
    sp_choices = choices if spec.honours_option(TPOptions, "sequence_parallel") and dims.tp > 1 else (False,)
    if cuts and tp_cut_refusal(model, dims.tp, True):
        sp_choices = tuple(sp for sp in sp_choices if not sp)
    out = []
    for sp in sp_choices:
        out.extend(replace(TPOptions(sequence_parallel=sp), saves=saves) for saves in _saves(search, sp))
    return out


def _saves(search: Search, sequence_parallel: bool) -> tuple[str, ...]:
    """Gathered always; sharded too where `check_tp_saves` takes it (the piece exists and this entry keeps
    it). Its one rule across families, no zero-bubble schedule, the run validator checks."""
    if not sequence_parallel:
        return ("gathered",)
    try:
        check_tp_saves(TPOptions(True, "sharded"), search.spec, (), search.dims)
    except LayoutError:
        return ("gathered",)
    return TP_SAVES
