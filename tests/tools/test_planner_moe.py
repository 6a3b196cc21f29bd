"""The planner's mixture-of-experts row through the one-layout mode (small_moe at dp 4 x ep 4): its model
state and all-to-all bytes are expert parallelism's closed forms (parallel/moe/theory.py, the figures every
ep run is checked against: tests/runs/test_ep.py), its activations the sandbox's MoE formula under uniform
routing (parallel/planner/moe.py, checked to the byte on runs by test_planner_memory.py), and it is timed."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launch.config import CONFIG_DIR
from parallel.core.shape import ModelShape
from parallel.dist.dims import ParallelDims
from parallel.layout import Layout
from parallel.moe.theory import ep_all_to_all_uniform_bytes, ep_model_state_bytes
from parallel.planner import moe
from parallel.planner.cluster import cluster_from_config
from parallel.planner.one import evaluate_layout


@pytest.fixture
def base_plan_row():
    """small_moe at dp 4 x ep 4 on two H100 nodes of 2 (the ep group across them) in fp32, the one-layout mode."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=["model=small_moe", "parallel=ep", "cluster=h100_sxm"])
        base = OmegaConf.to_container(compose(config_name="config", overrides=["model=small_moe"]), resolve=True)
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    preset = OmegaConf.to_container(cfg.cluster, resolve=True)
    preset.update(precision="fp32", gpus_per_node=2)
    cluster = cluster_from_config(preset, None, 4)
    row = evaluate_layout(shape, base, [], cluster, 4, 8, OmegaConf.to_container(cfg.parallel, resolve=True))
    layout = Layout(dims=ParallelDims(world_size=4, dp=4, ep=4), microbatches=1, microbatch_size=2)
    return row, layout, shape


def test_the_row_holds_theorys_model_state_and_all_to_all_bytes(base_plan_row):
    row, layout, shape = base_plan_row
    state = ep_model_state_bytes(shape.gpt, layout)
    memory = row["memory_bytes_per_device"]
    assert (memory["params"], memory["grads"], memory["optimizer"]) == \
        (state["param_bytes"], state["grad_bytes"], state["optimizer_bytes"])
    world = layout.dims.world_size
    uniform = ep_all_to_all_uniform_bytes(shape.gpt, layout) * world
    assert Fraction(row["bytes_by_group"]["ep"]) == pytest.approx(uniform)
    assert memory["activations"] == max(moe.sandbox_activation_bytes(shape, layout))
    assert row["step_time_s"]["total"] > 0 and row["step_time_s"]["exposed_comm"] > 0
    assert row["bytes_per_step"]["inter_node"] > 0 and row["bytes_per_step"]["intra_node"] > 0  # ep spans 2 nodes
