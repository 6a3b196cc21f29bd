"""The planner's mixture-of-experts row (parallel/planner/moe.py, predict.py) against the closed forms it
must equal: expert parallelism's model state and all-to-all bytes (parallel/moe/theory.py), and the
sandbox's saved bytes under uniform routing read two ways (the uniform call, and a measured routing that
happens to be uniform). The row against theory: tests/tools/test_planner_moe.py; the runs' check, to the
byte, tests/tools/test_planner_memory.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from launcher import PROJECT_ROOT

from parallel.core.config import GPTConfig
from parallel.core.shape import ModelShape
from parallel.dist.dims import ParallelDims
from parallel.layout import Layout
from parallel.planner import moe
from parallel.report.mfu import flops_per_token


def shape_of(name: str) -> ModelShape:
    return ModelShape(gpt=GPTConfig(**yaml.safe_load((PROJECT_ROOT / "conf" / "model" / f"{name}.yaml").read_text())))


def ep_layout(world: int, ep: int, m: int = 1, b: int = 2) -> Layout:
    return Layout(dims=ParallelDims(world_size=world, dp=world, ep=ep), microbatches=m, microbatch_size=b)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_uniform_routing_equals_a_measured_uniform_routing(ep):
    """Every sequence sending s·k/E assignments to each expert: the measured path (rank_rows of the
    counts) and the uniform call give the same bytes on every rank."""
    shape = shape_of("tiny_moe")
    g = shape.gpt
    layout = ep_layout(4, ep, m=2)
    per_expert = layout.microbatch_size * g.seq_len * g.moe_top_k // g.moe_experts
    calls = len(g.moe_blocks) * layout.microbatches
    routing = tuple(tuple((per_expert,) * g.moe_experts for _ in range(calls)) for _ in range(4))
    assert moe.sandbox_activation_bytes(shape, replace(layout, routing=routing)) == \
        moe.sandbox_activation_bytes(shape, layout)


def test_imbalance_and_capacity_bound_the_rows():
    shape = shape_of("small_moe")
    g, b = shape.gpt, 2
    even = moe.uniform_call(shape, b, ep=4)
    assert even.dispatched == even.received == b * g.seq_len * g.moe_top_k
    skewed = moe.uniform_call(shape, b, ep=4, imbalance=100.0)
    capacity = 40  # ceil(1.25 · 128 · 2 / 8) per expert and sequence
    assert skewed.received == b * g.moe_experts * capacity
    assert moe.uniform_call(shape, b, ep=1, imbalance=2.0).received == even.dispatched  # no ep: its own rows


def test_mfu_counts_the_active_parameters():
    for name in ("tiny_moe", "small_moe"):
        shape = shape_of(name)
        assert shape.flops_per_token() == flops_per_token(shape.gpt)
