"""The whole plan: enumerate, predict each layout, rank.

Ranking: layouts that fit first, fastest first (tokens per second, the same global batch for all;
among equals, fewer microbatches, then less memory); then those whose memory no formula covers;
then those that do not fit, closest to fitting first.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from parallel.core.shape import ModelShape
from parallel.dist.dims import SIZES
from parallel.family import hydra_value
from parallel.layout import FamilyOptions
from parallel.planner.bounds import step_time_floor
from parallel.planner.cluster import Cluster
from parallel.planner.enumerate import Candidate, Enumeration, Space, enumerate_layouts, refusal_rule
from parallel.planner.memory_floor import first_rank_over, model_state_over
from parallel.planner.predict import predict_row
from parallel.pp.rules import posting_refusal
from parallel.registry import differing_options, request_fields


@dataclass(frozen=True)
class Preset:
    """A conf/parallel/ preset: its file name, the strategy it asks for, and its families' options."""

    file: str
    name: str
    options: FamilyOptions = FamilyOptions()


def preset_for(candidate: Candidate, presets: list[Preset]) -> str | None:
    """The conf/parallel preset whose strategy was asked for and whose options (those the strategy that
    runs honours) differ least from the candidate's (its run command then overrides every layout field
    anyway), the preset named as the strategy first; None if there is none."""
    mine = [p for p in presets if p.name == candidate.requested]
    if not mine:
        return None
    layout, spec = candidate.layout, candidate.plan.spec
    return min(mine, key=lambda p: (differing_options(p.options, layout.options, spec), p.file != p.name,
                                    p.file)).file


def rank_key(row: dict) -> tuple:
    fits = row["fits"]
    group = 0 if fits else (1 if fits is None else 2)
    speed = -(row["tokens_per_s"] or 0.0)
    over = row["over_bytes"] if row["over_bytes"] is not None else float("inf")
    memory = row["memory_bytes_per_device"]["total"] or 0
    return (group, over if group == 2 else speed, row["layout"]["microbatches"], memory)


class Kept:
    """The rows found so far, by layout, and the step the search no longer needs to beat (`limit`): the
    `keep`-th fastest of the rows that fit, in each group `only` names (the slowest of those limits), or
    none (infinite) while a group has fewer. A layout slower than that ranks below `keep` rows of every
    group it could belong to, so none of the first `keep` rows of the table, nor of any group's, is lost;
    a row that fits and is slower is not kept. `played(row, candidate)`: false for a row that fits but
    that the pipeline executor could not run (`_posting_played`), asked only of the rows kept."""

    def __init__(self, make_row, keep: int | None, only: list[str] | None, played):
        self.make_row, self.keep, self.only, self.played = make_row, keep, only, played
        self.rows: dict[tuple, dict] = {}
        self.fastest: dict[str | None, list[float]] = {n: [] for n in (only or [None])}

    def __call__(self, key: tuple, candidate: Candidate) -> None:
        row, groups = self.make_row(candidate)
        if row is None:
            return
        if row["fits"] and row["step_time_s"] and row["step_time_s"]["total"] > self.limit():
            return
        if not self.played(row, candidate):
            return
        again = key in self.rows  # the same layout under a more specific strategy: counted once
        self.rows[key] = row
        if again or self.keep is None or not row["fits"] or not row["step_time_s"]:
            return
        for group in groups:
            times = self.fastest[group]
            heapq.heappush(times, -row["step_time_s"]["total"])
            if len(times) > self.keep:
                heapq.heappop(times)

    def limit(self) -> float:
        if self.keep is None or any(len(t) < self.keep for t in self.fastest.values()):
            return float("inf")
        return max(-t[0] for t in self.fastest.values())


def plan_rows(shape: ModelShape, base: dict, presets: list[Preset], cluster: Cluster, world: int, global_batch: int,
              space: Space, only: list[str] | None = None, keep: int | None = None) -> tuple[list[dict], Enumeration]:
    """Every valid layout's row, ranked; `only`: presets or registry names to keep. Requests whose
    model state alone is over the device are pruned before they are asked (`model_state_over`). With
    `keep`, the first `keep` rows that fit (of each name in `only`) are exact and complete: a request
    whose step-time floor (parallel/planner/bounds.py) is above the `keep`-th fastest row found so far is
    not asked (`Kept`), its rows would have ranked below them, nor one whose first pipeline rank's memory
    floor is over the device (`first_rank_over`), which cannot fit: the rows that do not fit are then
    those of the requests asked."""
    names = None
    if only is not None:
        by_file = {p.file: p.name for p in presets}
        names = sorted({by_file.get(n, n) for n in only})

    replayed: Counter = Counter()  # rows that fit whose pipeline posting then deadlocks, by rule

    def make_row(candidate: Candidate):
        preset = preset_for(candidate, presets)
        if only is not None and not (preset in only or candidate.plan.strategy in only or candidate.requested in only):
            return None, []
        row = predict_row(shape, candidate, cluster, preset, time_if_over=False)
        row["run_overrides"] = run_overrides(candidate, preset, presets)
        groups = [n for n in only if n in (preset, candidate.plan.strategy, candidate.requested)] if only else [None]
        return row, groups

    kept = Kept(make_row, keep, only, lambda row, candidate: _posting_played(row, candidate, replayed))
    floor = step_time_floor(shape, cluster, world, global_batch) if keep is not None else None
    heavy = first_rank_over(shape, cluster, world, global_batch, base["train"].get("precision", "fp32")) \
        if keep is not None else None
    found = enumerate_layouts(shape, base, world, global_batch, space, names, model_state_over(shape, cluster),
                              floor, kept, heavy)
    found.refused.update(replayed)
    rows = sorted(kept.rows.values(), key=rank_key)
    for i, row in enumerate(rows, 1):
        row["rank"] = i
    return rows, found


def _posting_played(row: dict, candidate: Candidate, refused: Counter) -> bool:
    """The search asks build_plan without replaying a pipeline's posting (most rows of a large search do
    not fit, and the replay is most of a request's cost): a row that fits is replayed here, and refused
    (counted by its rule) where the executor's posting would deadlock; one that does not fit says so."""
    if candidate.plan.layout.dims.pp < 2:
        return True
    if not row["fits"]:
        row["notes"].append("the pipeline's posting not replayed: the layout does not fit")
        return True
    why = posting_refusal(candidate.plan.layout, candidate.plan.backend)
    if why:
        refused[refusal_rule(why)] += 1
    return why is None


def run_overrides(candidate: Candidate, preset: str | None, presets: list[Preset]) -> list[str]:
    """The launch.train overrides that run exactly this layout: the preset, the sizes and microbatches,
    and each family's option that the request asked for otherwise than the preset composes it (the
    defaults where the strategy's own name is given); re-asked, the request runs the same layout."""
    request, plan = candidate.request, candidate.plan
    out = [f"parallel={preset or candidate.requested}"]
    out += [f"parallel.{key}={request[key]}" for key in SIZES if key in request]
    out.append(f"parallel.microbatches={plan.microbatches}")
    composed = next((p.options for p in presets if p.file == preset), FamilyOptions())
    out += [f"parallel.{key}={hydra_value(value)}" for key, value in request_fields(composed, request).items()]
    if "recompute" in request:
        out.append(f"train.recompute={request['recompute']}")
    out.append(f"train.global_batch={plan.global_batch}")
    return out
