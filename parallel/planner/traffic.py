"""Bytes per step, by group and by link class, from the registry's closed forms (the families' theory.py).

The registry's `comm` gives a layout's traffic per step summed over all ranks, by op and, where
a strategy has several groups, by group (`by_group`). Where it has no `by_group`, the group is
read off the ops: point-to-point sends belong to the pipeline (pp), collectives to the one other
dimension larger than 1 (dp for dp, ZeRO and FSDP; cp or ep where only they are split).

The dp group's bytes are split into reductions (all-reduce, reduce-scatter: gradients) and
all-gathers (ZeRO's parameters), because they overlap differently. The combined layouts' theory
counts each group's all-gathers itself. Elsewhere, under ZeRO the dp group all-gathers and
reduce-scatters while no other group all-gathers more than it reduce-scatters, so the dp group's
all-gathers less its reduce-scatters are all of the step's all-gathers less all of its
reduce-scatters, which with their sum (by_group) fixes both.

The closed forms take the model's shape (grouped-query attention, a gated MLP, no biases, a tied
head: parallel/core/shape.py), GPT-2's block and Llama's alike, and the planner reads them as they
are. One thing they do not count: a tied head split over several stages, whose last stage keeps a
copy of the token table (Megatron's embedding group). There the dp group's bytes, proportional to
the parameters each rank syncs, are scaled by Ψ_t(with the copy) / Ψ_t, Ψ_t the parameters on one
tp rank summed over stages, and the copy's gradient all-reduce between the first and last stage is
added to the pipeline's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from parallel.algebra import tp_shard_parameter_count
from parallel.compose.theory import chunks_per_rank
from parallel.core.shape import ModelShape
from parallel.dist.dims import DATA_PARALLEL, SIZES
from parallel.layout import Layout
from parallel.planner.links import GroupSpan, group_span
from parallel.planner.remedies import period_steps
from parallel.spec import StrategySpec

P2P_OPS = ("send", "recv")
# Groups whose every byte waits for the step's backward and reductions: HSDP's replicate group all-reduces
# the gradient shards once the shard group's reduce-scatters are in (parallel/zero/hsdp.py).
AFTER_STEP = ("dp_replicate",)


class NoTrafficFormula(ValueError):
    """The registry has no closed form for this layout (or cannot say which group sends what)."""


@dataclass(frozen=True)
class GroupTraffic:
    group: str
    total: Fraction  # bytes all ranks of the job send per step over this dimension's groups (theory)
    gathers: Fraction  # of which all-gathers (ZeRO's parameters; tp's sequence-parallel inputs)
    span: GroupSpan
    every: int = 1  # steps per sync: 1, or DiLoCo's H (total is then the mean per step, one sync over H)
    after_step: bool = False  # a sync that waits for the step (DiLoCo's outer all-reduce), not inside backward
    direct: Fraction = Fraction(0)  # of which all-to-all, each block sent straight to its member (links.py)

    def per_rank(self, world: int) -> float:
        return float(self.total) / world

    @property
    def inter(self) -> Fraction:
        return (self.total - self.direct) * self.span.inter_fraction + self.direct * self.span.direct_fraction


def _exact(block: dict) -> Fraction:
    return Fraction(block.get("sent_bytes_exact", block.get("sent_bytes", 0)))


def group_totals(figure: dict, layout: Layout) -> dict[str, Fraction]:
    """Bytes per step over each dimension's groups, all ranks (theory's `by_group`, or read off the ops)."""
    if "by_group" in figure:
        return {g: _exact(v) for g, v in figure["by_group"].items() if _exact(v)}
    by_op = {op: _exact(v) for op, v in figure.get("by_op", {}).items() if _exact(v)}
    out: dict[str, Fraction] = {}
    p2p = sum((v for op, v in by_op.items() if op in P2P_OPS), Fraction(0))
    if p2p:
        out["pp"] = p2p
    rest = sum((v for op, v in by_op.items() if op not in P2P_OPS), Fraction(0))
    if rest:
        split = [d for d in SIZES if d != "pp" and getattr(layout.dims, d) > 1]
        if "ep" in split and "dp" in split:
            split.remove("ep")  # ep is carved out of dp: a collective over the dp ranks is dp's
        if len(split) != 1:
            raise NoTrafficFormula(f"theory gives {float(rest):.0f} bytes of collectives but no by_group, "
                                   f"and the layout splits along {split or 'nothing'}")
        out[split[0]] = rest
    return out


def dp_gathers(figure: dict, totals: dict[str, Fraction], zero: int) -> dict[str, Fraction]:
    """The all-gathers of ZeRO's parameters, by group: the dp group's (0 for a plain all-reduce, whose
    int8 or fp8 form's all-gather is the second half of the reduction), or under hybrid sharding every
    all-gather, all the shard group's (its replicate group only all-reduces). A block-scaled format's
    reduce-scatter is an all-to-all (parallel.comm_dtype): a scatter all the same."""
    by_op = {op: _exact(v) for op, v in figure.get("by_op", {}).items()}
    own = figure.get("all_gather_sent_by_group_exact")
    if own is not None:  # theory counted each group's own (the combined layouts': sp's re-gathers are tp's)
        return {g: Fraction(v) for g, v in own.items() if g in DATA_PARALLEL} if zero else {}
    if "dp_shard" in totals:
        return {"dp_shard": by_op.get("all_gather", Fraction(0))}
    if not zero or "dp" not in totals:
        return {}
    scatters = by_op.get("reduce_scatter", Fraction(0)) + by_op.get("all_to_all", Fraction(0))
    return {"dp": (totals["dp"] + by_op.get("all_gather", Fraction(0)) - scatters) / 2}


def shape_factor(shape: ModelShape, layout: Layout, stage_layers: list[int]) -> Fraction:
    """Ψ_t(with a tied head's copy on the last stage) / Ψ_t: what scales the dp group's bytes; 1 where
    no stage holds a copy (the closed forms then count every parameter synced)."""
    if not (shape.tied_head and layout.dims.pp > 1):
        return Fraction(1)
    t, p = layout.dims.tp, layout.dims.pp
    mine = sum(shape.stage_parameters(t, n, r == 0, r == p - 1, p) for r, n in enumerate(stage_layers))
    return Fraction(mine, tp_shard_parameter_count(shape.gpt, t))


def layout_traffic(spec: StrategySpec, shape: ModelShape, layout: Layout, zero: int, gpus_per_node: int,
                   algorithm: str, stage_layers: list[int]) -> dict[str, GroupTraffic]:
    """Every group's bytes per step (all ranks), with how its groups sit on nodes."""
    try:
        figure = spec.comm(shape.gpt, layout)
    except ValueError as e:  # theory refuses what it has no formula for (e.g. tp of an MoE model)
        raise NoTrafficFormula(str(e)) from None
    totals = group_totals(figure, layout)
    gathers = dp_gathers(figure, totals, zero)
    factor = shape_factor(shape, layout, stage_layers)
    if "dp" in totals:
        totals["dp"] *= factor
        gathers["dp"] = gathers.get("dp", Fraction(0)) * factor
    if shape.tied_head and layout.dims.pp > 1:
        g = shape.gpt
        copy = g.padded_vocab_size * g.d_model // layout.dims.tp * layout.dtype_bytes
        pipelines = layout.dims.world_size // layout.dims.pp
        totals["pp"] = totals.get("pp", Fraction(0)) + 2 * pipelines * copy  # all-reduce over 2: S per rank
    dims, every, direct = layout.dims, period_steps(figure), all_to_all_bytes(figure, totals, factor)
    return {g: GroupTraffic(g, v, gathers.get(g, Fraction(0)),
                            group_span(dims, g, gpus_per_node, algorithm, chunks_per_rank(layout) if g == "pp" else 1),
                            every, "period_steps" in figure or g in AFTER_STEP, direct.get(g, Fraction(0)))
            for g, v in totals.items()}


def all_to_all_bytes(figure: dict, totals: dict[str, Fraction], factor: Fraction) -> dict[str, Fraction]:
    """The all-to-all bytes of the one group that sends collectives (the dp group's int8 and fp8
    reductions, a figure without `by_group`), which cross nodes as their peers sit, not as a ring's
    edges do; where a figure has groups of its own, each is taken as one algorithm's."""
    a2a = _exact(figure.get("by_op", {}).get("all_to_all", {}))
    groups = [g for g in totals if g != "pp"]
    if "by_group" in figure or not a2a or len(groups) != 1:
        return {}
    return {groups[0]: a2a * (factor if groups[0] == "dp" else 1)}


def bytes_by_link(traffic: dict[str, GroupTraffic]) -> dict[str, float]:
    """Bytes per step over all ranks, inside nodes and between them (the two sum to theory's total)."""
    inter = sum((t.inter for t in traffic.values()), Fraction(0))
    total = sum((t.total for t in traffic.values()), Fraction(0))
    return {"intra_node": float(total - inter), "inter_node": float(inter), "total": float(total)}
