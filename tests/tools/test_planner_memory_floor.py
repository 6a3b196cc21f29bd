"""The search's memory floor (parallel/planner/memory_floor.py) is under every row's memory.

A request whose first pipeline rank's floor is over the device is not asked (`Enumeration.heavy`), so
the floor must never exceed what memory.py computes: held here against every layout an exhaustive
search of a 15B shape on 16 devices predicts, on a cluster whose attention saves its s x s scores
(a100_80gb) and on one with flash attention (h100_sxm), every recompute mode, schedule and chunk
count; and the search that asks the floor keeps every row that fits, and drops only rows that do not.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launch.config import CONFIG_DIR
from parallel.core.shape import ModelShape
from parallel.planner import predict
from parallel.planner.cluster import cluster_from_config
from parallel.planner.enumerate import Config, Space
from parallel.planner.memory_floor import first_rank_floor
from parallel.planner.predict import predict_row
from parallel.planner.search import plan_rows
from parallel.registry import REGISTRY, parse_options

MODEL = ["model=gpt2_1p5b", "model.n_layers=32", "model.d_model=6144", "model.n_heads=48", "model.seq_len=2048"]
WORLD, GLOBAL_BATCH = 16, 32


def _setup(cluster_name: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=[*MODEL, f"cluster={cluster_name}"])
        base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    cluster = cluster_from_config(OmegaConf.to_container(cfg.cluster, resolve=True), None, WORLD)
    searched = OmegaConf.to_container(cfg.plan.search, resolve=True)
    space = Space(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in searched.items()},
                     "context_parallel": False})  # as launch.plan searches in bf16
    return shape, base, cluster, space


@pytest.mark.parametrize("cluster_name", ["a100_80gb", "h100_sxm"])
def test_no_row_holds_less_than_its_memory_floor(cluster_name):
    shape, base, cluster, space = _setup(cluster_name)
    _, found = plan_rows(shape, base, [], cluster, WORLD, GLOBAL_BATCH, space)  # exhaustive: no floor asked
    floor = first_rank_floor(shape, cluster, WORLD, GLOBAL_BATCH, base["train"].get("precision", "fp32"))
    schedules, over = set(), 0
    for candidate in found.candidates:
        row = predict_row(shape, candidate, cluster, None, time_if_over=False)
        first = row["memory_by_stage"][0]
        known = sum(v for k, v in first.items() if k != "total" and v is not None)  # the total, where it is known
        bytes_ = floor(REGISTRY[candidate.requested], candidate.request, parse_options(Config(candidate.request)))
        assert bytes_ <= known, (candidate.request, bytes_, known)
        over += bytes_ > cluster.usable_bytes
        schedules.add(row["layout"]["schedule"])
    assert len(found.candidates) > 1000 and over > 100  # the floor is not a trivial one
    assert schedules >= {"gpipe", "1f1b", "interleaved_1f1b", "zbh1", "zbv"}


def test_the_search_asking_the_floor_keeps_every_row_that_fits():
    shape, base, cluster, space = _setup("a100_80gb")
    every, _ = plan_rows(shape, base, [], cluster, WORLD, GLOBAL_BATCH, space)
    # A keep no search reaches: the step-time floor never leaves a request out, the memory floor does.
    kept, found = plan_rows(shape, base, [], cluster, WORLD, GLOBAL_BATCH, space, keep=10**6)

    def key(row: dict) -> str:
        return json.dumps([row["layout"], row["memory_bytes_per_device"], row["step_time_s"]], sort_keys=True)

    fitting = {key(r) for r in every if r["fits"]}
    assert fitting and {key(r) for r in kept if r["fits"]} == fitting
    assert {key(r) for r in kept} <= {key(r) for r in every}
    assert found.heavy > 0 and len(kept) < len(every)


def test_a_request_run_plan_will_refuse_gets_a_floor_not_an_error(monkeypatch):
    """The floor is asked before run_plan.py: interleaved 1F1B with m not a multiple of p, the first request
    of its dimensions (no formula answer cached), has no walk to take, and gets its model state alone."""
    shape, base, cluster, _ = _setup("a100_80gb")
    monkeypatch.setattr(predict, "_FORMULA", {})
    request = {"dp": 2, "tp": 1, "pp": 8, "cp": 1, "ep": 1, "dp_shard": 1, "microbatches": 4,
               "schedule": "interleaved_1f1b", "virtual_stages": 2, "zero": 1, "recompute": "none"}
    floor = first_rank_floor(shape, cluster, WORLD, GLOBAL_BATCH, "fp32")
    bytes_ = floor(REGISTRY["3d"], request, parse_options(Config(request)))
    layer = shape.layer_parameters(1)
    assert bytes_ == pytest.approx(shape.gpt.n_layers // 8 * layer * (2 + 2 + 12 / 2))
