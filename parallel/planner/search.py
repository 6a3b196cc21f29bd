"""The whole plan: enumerate, predict each layout, rank.

Ranking: layouts that fit first, fastest first (tokens per second, the same global batch for all;
among equals, fewer microbatches, then less memory); then those whose memory no formula covers;
then those that do not fit, closest to fitting first.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.core.shape import ModelShape
from parallel.dist.dims import SIZES
from parallel.family import hydra_value
from parallel.layout import FamilyOptions
from parallel.model_state import STATE_BYTES
from parallel.planner.cluster import Cluster
from parallel.planner.enumerate import Candidate, Enumeration, Space, enumerate_layouts
from parallel.planner.predict import predict_row
from parallel.registry import differing_options, request_fields
from parallel.sync.options import SyncOptions


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


def model_state_over(shape: ModelShape, cluster: Cluster):
    """A test no layout it refuses could pass: the model state a request's fullest rank holds is at
    least its blocks' parameters over tp and pp (the fullest stage holds at least the mean; the
    embedding and head left out), at the precision's bytes per parameter, ZeRO dividing what its
    stage shards by at most dp·cp, or dp_shard under hybrid sharding (a strategy without parallel.zero
    counted as sharding everything, ZeRO-3). Over the device's usable memory, the request cannot fit,
    so the search does not ask build_plan about it nor time it. None for a mixture of experts (its
    experts divide over ep)."""
    if shape.gpt.moe_experts:
        return None
    param_b, grad_b, optim_b = STATE_BYTES[cluster.precision]

    def beyond(spec, request: dict) -> bool:
        held = shape.gpt.n_layers * shape.layer_parameters(request["tp"]) / request["pp"]
        zero = request.get("zero", 0) if spec.honours_option(SyncOptions, "zero") else 3
        shard = request.get("dp_shard", 1)  # hybrid sharding: ZeRO over a shard group only
        d = shard if shard > 1 else request["dp"] * request.get("cp", 1)
        per = param_b / (d if zero >= 3 else 1) + grad_b / (d if zero >= 2 else 1) + optim_b / (d if zero >= 1 else 1)
        return held * per > cluster.usable_bytes

    return beyond


def plan_rows(shape: ModelShape, base: dict, presets: list[Preset], cluster: Cluster, world: int, global_batch: int,
              space: Space, only: list[str] | None = None) -> tuple[list[dict], Enumeration]:
    """Every valid layout's row, ranked; `only`: presets or registry names to keep. Requests whose
    model state alone is over the device are pruned before they are asked (`model_state_over`)."""
    names = None
    if only is not None:
        by_file = {p.file: p.name for p in presets}
        names = sorted({by_file.get(n, n) for n in only})
    found = enumerate_layouts(shape, base, world, global_batch, space, names, model_state_over(shape, cluster))
    rows = []
    for candidate in found.candidates:
        preset = preset_for(candidate, presets)
        row = predict_row(shape, candidate, cluster, preset, time_if_over=False)
        row["run_overrides"] = run_overrides(candidate, preset, presets)
        if only is None or preset in only or candidate.plan.strategy in only or candidate.requested in only:
            rows.append(row)
    rows.sort(key=rank_key)
    for i, row in enumerate(rows, 1):
        row["rank"] = i
    return rows, found


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
