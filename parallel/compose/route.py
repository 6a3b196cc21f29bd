"""What runs: a requested strategy, the layout and the ZeRO stage of its dp dimension -> the entry
that runs it. `ROUTES` below is the table; `resolve` reads it, and nothing else decides.

How to read it. A request starts at its name (`parallel.name`, after the preset) with every
family's options as the run validator parsed them, parallel.zero = k among them, and the values the
requested entry sets (`StrategySpec.sets`: `cp_a2a` asks for the all-to-all wherever its layout
runs). The first row that matches the current name, the layout and k says where to go: another
entry (and the options it changes, family by family), `itself` (stop here), or `refused` (one of
parallel/zero/rules.py's refusals, one line that names the fix). From the entry reached the table
is read again, until no row matches or a row says `itself`. ZERO_DP matches every entry that
honours parallel.zero (dp, tp, pp, 3d, cp, cp_a2a; a strategy registered at run time too),
NO_ZERO_DP every other one.

What the rows mean. Over one rank a dimension cuts nothing: tp over one rank is dp (and sequence
parallelism over one rank nothing either: the options are dp's defaults), cp over one rank is dp,
ep over one rank is dp, and dp (or a pipeline) in one plain process is the single run, unless ZeRO
is asked for, which is then refused: there is nothing to shard over. Tensor, pipeline and context
parallelism together are the one recipe `3d` (parallel/compose/combined.py). parallel.zero = k picks
the dp dimension's sync: on a pure dp layout it is the strategy `zero<k>` (the stage then in the
name, the option 0); under context parallelism ZeRO-1/2 shard over the dp·cp ranks inside the
strategy that runs (cp, cp_a2a or 3d); with tp or pp it is the 3d recipe's ZeroOptimizer over the
dp group. ZeRO-3 is a strategy of its own (zero3) and composes with no other dimension.

The layout column is `any`, or conditions on the dimensions (world, dp, tp, pp, cp, ep) written
`d=n` or `d>n`, joined by `and` or by `or`; the zero column `any`, a stage, or a range `a-b`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from parallel.dist.dims import SIZES, ParallelDims
from parallel.layout import FamilyOptions
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions
from parallel.zero import rules as zero_rules

# What a `refused` row names: the refusals of parallel/zero/rules.py, each (name, dims, zero) -> raises.
REFUSALS = {f.__name__: f for f in (zero_rules.no_dp_sync, zero_rules.zero3_with_cp, zero_rules.one_dp_rank,
                                    zero_rules.zero3_with_tp_pp)}


@dataclass(frozen=True)
class Route:
    """One row of the table."""

    names: frozenset | None  # the entries it applies to, or None with `zero_dp` set
    zero_dp: bool | None  # ZERO_DP / NO_ZERO_DP: every entry that honours parallel.zero (or does not)
    layout: str  # the condition on the dimensions, as written
    zero: range | None  # the stages it applies to (None: any)
    runs: str  # an entry, "itself", "zero<k>" or "refused: <refusal>"
    changes: dict  # family -> the options the row sets, e.g. {"tp": {"sequence_parallel": False}}

    def matches(self, spec: StrategySpec, dims: ParallelDims, zero: int) -> bool:
        if self.names is not None and spec.name not in self.names:
            return False
        if self.zero_dp is not None and spec.honours_option(SyncOptions, "zero") != self.zero_dp:
            return False
        return (self.zero is None or zero in self.zero) and _holds(self.layout, dims)


_TERM = re.compile(rf"(world|{'|'.join(SIZES)})([=>])(\d+)")  # every dimension of parallel/dist/dims.py


def _term(term: str, dims: ParallelDims) -> bool:
    found = _TERM.fullmatch(term)
    if found is None:
        raise ValueError(f"route table: {term!r} is not a condition on a dimension (e.g. tp>1, world=1)")
    dim, op, n = found.groups()
    value = dims.world_size if dim == "world" else getattr(dims, dim)
    return value == int(n) if op == "=" else value > int(n)


def _holds(layout: str, dims: ParallelDims) -> bool:
    if layout == "any":
        return True
    if " or " in layout:
        return any(_term(t, dims) for t in layout.split(" or "))
    return all(_term(t, dims) for t in layout.split(" and "))


def _stages(text: str) -> range | None:
    if text == "any":
        return None
    low, _, high = text.partition("-")
    return range(int(low), int(high or low) + 1)





ZERO_DP, NO_ZERO_DP = True, False  # a row for every entry that honours parallel.zero (or does not)


def route(requested, layout: str, stages: str, runs: str, **changes) -> Route:
    """One row as it reads: `requested` a name, several names apart by spaces, or ZERO_DP / NO_ZERO_DP."""
    by_flag = isinstance(requested, bool)
    return Route(names=None if by_flag else frozenset(requested.split()), zero_dp=requested if by_flag else None,
                 layout=layout, zero=_stages(stages), runs=runs, changes=changes)


ROUTES: tuple[Route, ...] = (
    #     requested     layout            zero   runs
    route("dp",         "world=1",        "0",   "single"),
    route("ep",         "ep=1",           "any", "dp"),
    route("tp",         "pp>1 or cp>1",   "any", "3d"),
    route("tp",         "tp=1",           "any", "dp", tp={"sequence_parallel": False}, cp={"kind": "ring"}),
    route("pp",         "tp>1 or cp>1",   "any", "3d"),
    route("pp 3d",      "world=1",        "0",   "single"),
    route("cp cp_a2a",  "tp>1 or pp>1",   "any", "3d"),
    route("cp cp_a2a",  "cp=1",           "any", "dp"),
    route(NO_ZERO_DP,   "any",            "1-3", "refused: no_dp_sync"),
    route(ZERO_DP,      "cp>1",           "3",   "refused: zero3_with_cp"),
    route(ZERO_DP,      "cp>1",           "1-2", "itself"),
    route(ZERO_DP,      "dp=1",           "1-3", "refused: one_dp_rank"),
    route(ZERO_DP,      "tp=1 and pp=1",  "1-3", "zero<k>", sync={"zero": 0}),
    route(ZERO_DP,      "any",            "3",   "refused: zero3_with_tp_pp"),
    route(ZERO_DP,      "any",            "1-2", "3d"),
)
for _row in ROUTES:  # a condition that is not one fails at import, not in some run
    _holds(_row.layout, ParallelDims(1, 1))


def check_names(known, routes: tuple[Route, ...] = ROUTES) -> None:
    """The table names what exists (the registry calls this once it is built, so that a typo in a
    row fails at import, not in some run)."""
    for r in routes:
        targets = {*(r.names or ()), *([] if r.runs in ("itself", "zero<k>") or r.runs.startswith("refused")
                                       else [r.runs])}
        assert targets <= set(known), f"route table names {targets - set(known)}"
        assert not r.runs.startswith("refused") or r.runs.split(": ")[1] in REFUSALS, r.runs


def resolve(name: str, dims: ParallelDims, options: FamilyOptions,
            specs: Mapping[str, StrategySpec]) -> tuple[str, FamilyOptions]:
    """The entry that runs a requested name on this layout, by the table above, among `specs` (the
    registry: parallel/registry.py's `resolve` passes it). Returns (name, options as they apply to
    it); raises the row's refusal where none can. `options` holds every family's record."""
    for family, values in specs[name].sets.items():  # `cp_a2a` asks for the all-to-all wherever it is routed
        options = options.changed(family, **values)
    seen = {name}
    while True:
        zero = options.of(SyncOptions).zero
        row = next((r for r in ROUTES if r.matches(specs[name], dims, zero)), None)
        if row is None or row.runs in ("itself", name):
            return name, options
        if row.runs.startswith("refused: "):
            REFUSALS[row.runs.removeprefix("refused: ")](name, dims, zero)
        name = f"zero{zero}" if row.runs == "zero<k>" else row.runs
        for family, values in row.changes.items():
            options = options.changed(family, **values)
        if name in seen:
            raise AssertionError(f"strategy routes loop through {name}")
        seen.add(name)
