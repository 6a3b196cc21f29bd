"""The planner's search at the scale it is built for, and the pipeline timing it runs on.

A 3,072-device search of Megatron's 1008B shape (Narayanan et al. 2021, Table 1) completes and finds
layouts that fit; what the search leaves out before asking run_plan.py (`model_state_over`) could not have
fitted, and what its step-time floor leaves out (parallel/planner/bounds.py) could not have ranked first.
The bubble is the schedule's closed form where it claims one and the simulator on the schedule's
own placement elsewhere: both equal the simulator's makespan, for every registered schedule.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launch.config import CONFIG_DIR
from parallel.core.shape import ModelShape
from parallel.planner.cluster import cluster_from_config
from parallel.planner.enumerate import Space
from parallel.planner.search import model_state_over, plan_rows
from parallel.pp.actions import SEND_B, SEND_F, B, F, W
from parallel.pp.schedules import SCHEDULES, ScheduleError, build_schedule, schedule_placement
from parallel.pp.simulator import simulate
from parallel.pp.theory import schedule_makespan as pipeline_makespan
from parallel.registry import REGISTRY


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipeline_makespan_is_the_simulators_on_the_schedules_own_placement(name):
    """The V-shaped schedules (zbv, dualpipev) used to be played on the loop placement, which reads
    their lists as invalid (ScheduleInvalid: 'F0.1 runs before its input exists')."""
    checked = 0
    for p in (2, 4, 8):
        for m in (1, 2, 4, 8, 16):
            for v in (1, 2, 4):
                try:
                    plans = build_schedule(name, p, m, v)
                except ScheduleError:
                    continue
                split = any(a.op == W for actions in plans for a in actions)
                for send in (0.0, 0.3):
                    def cost(a, virtual, _split=False, send=send, backward=1.15 if split else 2.3):
                        if a.op == F:
                            return 1.0 / virtual
                        if a.op in (B, W):
                            return backward / virtual
                        return send if a.op in (SEND_F, SEND_B) else 0.0

                    expected = simulate(plans, m, v, cost, schedule_placement(name, p, v)).makespan
                    assert pipeline_makespan(name, p, m, v, 1.0, 2.3, send) == pytest.approx(expected, rel=1e-12)
                    checked += 1
    assert checked > 0


def test_a_3072_device_search_of_the_1008b_shape_finds_layouts_that_fit():
    model = ["model=gpt2_1p5b", "model.n_layers=128", "model.d_model=25600", "model.n_heads=160",
             "model.vocab_size=51200", "model.seq_len=2048"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=[*model, "cluster=a100_80gb"])
        base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    cluster = cluster_from_config(OmegaConf.to_container(cfg.cluster, resolve=True), None, 3072)
    searched = OmegaConf.to_container(cfg.plan.search, resolve=True)
    space = Space(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in searched.items()},
                     "context_parallel": False})  # as launch.plan searches in bf16
    rows, found = plan_rows(shape, base, [], cluster, 3072, 3072, space, keep=1)
    fitting = [r for r in rows if r["fits"]]
    assert fitting and found.pruned > 0 and found.bounded > 0
    assert all(r["step_time_s"] and r["step_time_s"]["total"] > 0 for r in fitting)
    assert rows[0]["fits"] and rows[0]["layout"]["tp"] * rows[0]["layout"]["pp"] >= 64
    totals = [r["step_time_s"]["total"] for r in fitting]
    assert totals == sorted(totals)
    # What was pruned could not fit: its blocks' model state alone is over the device, on every rank.
    beyond = model_state_over(shape, cluster)
    spec = REGISTRY["3d"]
    pruned = {"dp": 3072, "tp": 1, "pp": 1, "cp": 1, "zero": 1}
    assert beyond(spec, pruned)
    assert shape.gpt.n_layers * shape.layer_parameters(1) * (2 + 2 + 12 / 3072) > cluster.usable_bytes


def test_the_search_finds_the_layout_that_fits_only_saving_the_sequence_piece():
    """llama3_8b, 32768 tokens on 8 H100s, tp's own strategy without ZeRO or recomputation: the fastest
    layout that fits, dp 2 x tp 4 with sequence parallelism, fits only keeping this rank's sequence piece
    of each column-parallel input (parallel.tp_saves=sharded, Megatron's): saving the all-gathered inputs
    (2·s·b·h per layer) puts it over the device. The search asks for both and ranks it first."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=["model=llama3_8b", "model.seq_len=32768", "cluster=h100_sxm"])
        base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    cluster = cluster_from_config(OmegaConf.to_container(cfg.cluster, resolve=True), None, 8)
    space = Space(zero=(0,), recompute=("none",), context_parallel=False)
    rows, _ = plan_rows(shape, base, [], cluster, 8, 8, space, only=["tp"])
    best = rows[0]
    layout = best["layout"]
    assert best["fits"] and layout["tp_saves"] == "sharded" and (layout["dp"], layout["tp"]) == (2, 4)
    assert "parallel.tp_saves=sharded" in best["run_overrides"]
    same = ("dp", "tp", "microbatches", "sequence_parallel")
    twin = [r for r in rows if r["layout"]["tp_saves"] == "gathered" and all(r["layout"][k] == layout[k] for k in same)]
    assert len(twin) == 1 and twin[0]["fits"] is False
    assert twin[0]["memory_bytes_per_device"]["total"] > cluster.usable_bytes > best["memory_bytes_per_device"]["total"]
