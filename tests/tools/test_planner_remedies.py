"""The planner on the three remedies for slow links (docs/theory/planner.md, "Remedies"): hybrid sharding
(hsdp, hsdp_zero2, torch_hsdp), low-precision collectives (parallel.comm_dtype) and DiLoCo (parallel=diloco).
Without training: the bytes per group and per link class against the families' closed forms, exactly; where
each group's ranks sit (the shard group inside a node, the replicate group across); the time rules on a
synthetic cluster worked out by hand; memory against the registry's model state.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import yaml
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT
from omegaconf import OmegaConf
from options import option
from test_planner import synthetic_cluster

from launch.config import CONFIG_DIR
from parallel.algebra import all_reduce_sent_per_rank, parameter_count
from parallel.core.shape import ModelShape
from parallel.diloco.options import DiLoCoOptions
from parallel.dist.dims import ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.planner import memory
from parallel.planner.enumerate import Space, candidate_of, enumerate_layouts
from parallel.planner.links import group_span
from parallel.planner.predict import predict_row
from parallel.planner.report import layout_label
from parallel.planner.timing import BUCKET_BYTES, _dp_exposed
from parallel.planner.traffic import GroupTraffic, bytes_by_link, layout_traffic
from parallel.planner.validate import per_step
from parallel.run_plan import build_plan


# -- the time rules, on traffic given by hand ----------------------------------------------------------------
def _group(name: str, total: float, gathers: float = 0, size: int = 4, every: int = 1,
           after: bool = False) -> GroupTraffic:
    span = group_span(ParallelDims(size, size), "dp", size, "ring")
    return GroupTraffic(name, Fraction(total), Fraction(gathers), span, every, after_step=after or every > 1)


def test_reductions_share_one_backward_window_and_a_sync_after_the_step_hides_nowhere():
    """Two groups' reductions in one backward (dp and the experts' edp) are set together against it,
    not each alone. A sync that waits for the step (HSDP's replicate all-reduce, DiLoCo's outer one
    every H steps) is exposed whole; so are ZeRO's gathers."""
    world, per_rank = 4, 1e8
    traffic = {"dp": _group("dp", 2 * per_rank * world, gathers=per_rank * world),
               "edp": _group("edp", per_rank / 2 * world)}
    seconds = {"dp": 0.8, "edp": 0.2}  # dp's: half gathers, half reduce-scatters
    # Reductions 0.4 + 0.2 s against a 0.3 s backward: 0.3 s shows, plus the 0.4 s of gathers.
    assert _dp_exposed(traffic, seconds, 3, None, 0.3, world) == pytest.approx(0.4 + 0.3)
    # A long backward hides them but for the last bucket of the larger: 25 MiB of its 100 MB per rank.
    last = 0.4 * BUCKET_BYTES / per_rank
    assert _dp_exposed(traffic, seconds, 3, None, 10.0, world) == pytest.approx(0.4 + last)
    hsdp = {"dp_shard": traffic["dp"], "dp_replicate": _group("dp_replicate", per_rank / 2 * world, after=True)}
    assert _dp_exposed(hsdp, {"dp_shard": 0.8, "dp_replicate": 0.2}, 3, None, 10.0, world) == pytest.approx(
        0.4 + last + 0.2)
    outer = {"dp": _group("dp", per_rank, every=10)}
    assert _dp_exposed(outer, {"dp": 0.03}, 0, "bucketed", 10.0, world) == pytest.approx(0.03)


# -- bytes per group and link class against the closed forms ------------------------------------------------
@pytest.fixture(scope="module")
def base() -> dict:
    """The training config of each model preset, composed once."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return {m: OmegaConf.to_container(compose(config_name="config", overrides=[f"model={m}"]), resolve=True)
                for m in ("tiny", "tiny_llama")}


def _planned(base: dict, model: str, world: int, gpus_per_node: int, algorithm: str = "ring", **parallel):
    """build_plan's plan of `parallel` on `world` ranks, its candidate and the planner's traffic."""
    shape = ModelShape.from_preset(yaml.safe_load((PROJECT_ROOT / "conf" / "model" / f"{model}.yaml").read_text()))
    cfg = OmegaConf.create(base[model])
    cfg.parallel.update(parallel)
    plan = build_plan(cfg, LaunchEnv(0, world, 0, world), cuda_available=False)
    candidate = candidate_of(parallel["name"], plan, {})
    traffic = layout_traffic(plan.spec, shape, plan.layout, candidate.zero, gpus_per_node, algorithm,
                             memory.rank_layers(shape, plan.layout))
    return shape, plan, candidate, traffic


def _exact(figure: dict, group: str | None = None) -> Fraction:
    block = figure["by_group"][group] if group else figure
    return Fraction(block["sent_bytes_exact"] if group else figure["sent_bytes_per_step_exact"])


@pytest.mark.parametrize("name,model,stage", [("hsdp", "tiny", 3), ("hsdp_zero2", "tiny_llama", 2),
                                              ("torch_hsdp", "tiny", 3)])
def test_hybrid_sharding_keeps_its_shard_group_in_a_node_and_sends_only_the_shard_all_reduce_across(
        base, name, model, stage):
    """8 ranks on 2 nodes of 4, dp_shard = 4: each group's bytes are the closed form's to the byte; the
    shard group never leaves its node and the replicate group (ranks i and i + 4) always crosses, so the
    inter-node bytes are the all-reduce of the gradient shard, 2(R-1)/R·G_S per rank, and nothing else."""
    for algorithm in ("ring", "hierarchical"):
        shape, plan, candidate, traffic = _planned(base, model, 8, 4, algorithm, name=name, dp_shard=4,
                                                   microbatches=2)
        figure = plan.spec.comm(plan.model, plan.layout)
        assert candidate.zero == stage and set(traffic) == {"dp_shard", "dp_replicate"}
        for group in traffic:
            assert traffic[group].total == _exact(figure, group)
        links = bytes_by_link(traffic)
        assert traffic["dp_shard"].inter == 0 and traffic["dp_replicate"].inter == traffic["dp_replicate"].total
        shard = figure["gradient_shard_bytes"]
        assert Fraction(links["inter_node"]) == 8 * all_reduce_sent_per_rank(2, shard)
        assert links["intra_node"] + links["inter_node"] == pytest.approx(float(_exact(figure)))
        # The shard group's all-gathers are ZeRO's parameters (exposed); the replicate group gathers nothing.
        assert traffic["dp_shard"].gathers == Fraction(figure["by_op"]["all_gather"]["sent_bytes_exact"])
        assert traffic["dp_replicate"].gathers == 0
        # The replicate all-reduce waits for the step's reduce-scatters: it hides behind nothing.
        assert traffic["dp_replicate"].after_step and not traffic["dp_shard"].after_step
    # ZeRO-3 over all 8 sends its gathers and scatters across; HSDP one shard's all-reduce.
    _, zplan, _, zero3 = _planned(base, model, 8, 4, name="zero3", microbatches=2)
    assert bytes_by_link(zero3)["inter_node"] > 4 * links["inter_node"]


def test_hybrid_sharding_memory_is_zero_over_the_shard_group(base):
    """The model state per rank is the registry's (ZeRO-3 or ZeRO-2 over dp_shard ranks), in a row of the plan."""
    cluster = synthetic_cluster()
    for name in ("hsdp", "hsdp_zero2"):
        shape, plan, candidate, _ = _planned(base, "tiny", 8, 4, name=name, dp_shard=4)
        row = predict_row(shape, candidate, cluster, name)
        held = plan.spec.model_state(plan.model, plan.layout)
        state = row["memory_bytes_per_device"]
        assert (state["params"], state["grads"], state["optimizer"]) == (
            held["param_bytes"], held["grad_bytes"], held["optimizer_bytes"])
        assert row["bytes_by_group"].keys() == {"dp_shard", "dp_replicate"} and row["step_time_s"]["total"] > 0


@pytest.mark.parametrize("model,fragments", [("tiny", 1), ("tiny_llama", 2)])
def test_diloco_sends_one_all_reduce_per_h_steps_exposed_and_keeps_its_outer_state(base, model, fragments):
    """The row's bytes are the closed form's mean per step, one sync over H; its time one sync's
    seconds over H, hidden behind nothing (4 ranks in one node of the synthetic cluster: 1 GB/s, no
    latency); its memory the registry's, the outer copy and momentum counted with the optimizer."""
    h = 10
    shape, plan, candidate, traffic = _planned(base, model, 4, 4, name="diloco", inner_steps=h,
                                               outer_momentum=0.9, fragments=fragments)
    figure = plan.spec.comm(plan.model, plan.layout)
    assert set(traffic) == {"dp"} and traffic["dp"].total == _exact(figure)
    assert traffic["dp"].every == h and traffic["dp"].after_step and traffic["dp"].inter == 0
    one_sync = 2 * 3 / 4 * parameter_count(plan.model) * 4  # bytes per rank of the whole model's all-reduce
    assert float(traffic["dp"].total) / 4 == pytest.approx(one_sync / h)
    row = predict_row(shape, candidate, synthetic_cluster(), "diloco")
    assert row["step_time_s"]["exposed_comm"] == pytest.approx(one_sync / 1e9 / h)
    held = plan.spec.model_state(plan.model, plan.layout)
    state = row["memory_bytes_per_device"]
    assert (state["params"], state["grads"], state["optimizer"]) == (
        held["param_bytes"], held["grad_bytes"], held["optimizer_bytes"])
    assert any("loss cost is not modelled" in n for n in row["notes"])


@pytest.mark.parametrize("model", ["tiny", "tiny_llama"])
def test_low_precision_collectives_send_the_formats_bytes_and_scales_on_each_link_class(base, model):
    """dp and ZeRO with parallel.comm_dtype on 8 ranks over 2 nodes: the row's bytes are the closed form's
    (payload and block scales) to the byte, split as fp32's are; bf16 halves dp's; int8's all-to-all and
    all-gather are a reduction, not parameter gathers; ZeRO-3's int8 weight gathers stay gathers."""
    fp32 = {}
    for name, fmt in (("dp", "fp32"), ("dp", "bf16"), ("dp", "int8"), ("zero3", "fp32"), ("zero3", "int8")):
        _, plan, candidate, traffic = _planned(base, model, 8, 4, name=name, comm_dtype=fmt)
        figure = plan.spec.comm(plan.model, plan.layout)
        links = bytes_by_link(traffic)
        assert set(traffic) == {"dp"} and traffic["dp"].total == _exact(figure)
        ops = figure["by_op"]
        # A ring over 2 nodes crosses on 2 of its 8 edges; an all-to-all sends 4 of each member's 7 blocks across.
        a2a = Fraction(ops["all_to_all"]["sent_bytes_exact"]) if fmt == "int8" else 0
        assert traffic["dp"].inter == (traffic["dp"].total - a2a) / 4 + a2a * Fraction(4, 7)
        gathers = Fraction(ops["all_gather"]["sent_bytes_exact"]) if name == "zero3" else 0
        assert traffic["dp"].gathers == gathers
        fp32.setdefault(name, links["total"])
        if fmt == "bf16":
            assert links["total"] == fp32[name] / 2
        if fmt == "int8":
            assert fp32[name] * 65 / 256 <= links["total"] < fp32[name] * 0.3  # 1 byte + 4 per 256, padded


def test_the_search_weighs_each_format_and_each_h_asked_for(base):
    """plan.search.comm_dtype and inner_steps: one row per format and per H, each told apart and labelled."""
    shape = ModelShape.from_preset(yaml.safe_load((PROJECT_ROOT / "conf" / "model" / "tiny.yaml").read_text()))
    space = Space(zero=[0], comm_dtype=["fp32", "bf16", "int8"], inner_steps=[10, 50], recompute=["none"],
                  max_microbatches=1)
    found = enumerate_layouts(shape, base["tiny"], 4, 16, space, ["dp", "diloco", "hsdp"])
    seen = {(c.plan.strategy, option(c.plan, "comm_dtype"), c.layout.dims.dp_shard,
             c.layout.of(DiLoCoOptions).inner_steps if c.plan.strategy == "diloco" else None) for c in found.candidates}
    assert seen == {("dp", "fp32", 1, None), ("dp", "bf16", 1, None), ("dp", "int8", 1, None),
                    ("diloco", "fp32", 1, 10), ("diloco", "fp32", 1, 50), ("hsdp", "fp32", 2, None)}
    labels = {layout_label(predict_row(shape, c, synthetic_cluster(), None)["layout"]) for c in found.candidates}
    assert {"4x1x1 m1x4 bf16", "4x1x1 m1x4 int8", "4x1x1 m1x4 H50", "4x1x1 dp_shard2 m1x4 zero3"} <= labels


def test_a_periodic_runs_step_and_bytes_are_measured_over_its_whole_periods():
    """The validation compares DiLoCo's row (a sync spread over H steps) with the mean of the timed steps
    in whole periods and the last period's mean bytes; every other run with its median step and last step."""
    summary = {"expected_comm": {"period_steps": 3}, "warmup_steps": 1, "step_time_s": 1.0,
               "step_times_s": [9.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 4.0],
               "comm": {"sent_bytes_per_step_exact": "30", "sent_bytes_by_step": [0, 0, 0, 30, 0, 0, 30, 0]}}
    assert per_step(summary) == (2.0, Fraction(10))  # the 6 last timed steps: two periods of 1 + 1 + 4
    summary["expected_comm"] = {}
    assert per_step(summary) == (1.0, Fraction(30))


def test_an_all_to_all_is_timed_as_its_blocks_go_not_as_a_ring(base):
    """dp int8 on 8 ranks, 2 nodes of 4, the synthetic cluster (1 GB/s inside, 0.1 GB/s between, no
    latency, hierarchical): the all-gather half at (k-1)/(N-1) = 1/7 between nodes, the all-to-all half
    at 4/7, each member's 4 peers on the other node; worked by hand."""
    shape, plan, candidate, _ = _planned(base, "tiny", 8, 4, name="dp", comm_dtype="int8")
    ops = plan.spec.comm(plan.model, plan.layout)["by_op"]
    ag, a2a = (float(Fraction(ops[op]["sent_bytes_exact"])) / 8 for op in ("all_gather", "all_to_all"))
    row = predict_row(shape, candidate, synthetic_cluster(), "dp_int8")
    expected = ag * (6 / 7 / 1e9 + 1 / 7 / 1e8) + a2a * (3 / 7 / 1e9 + 4 / 7 / 1e8)
    assert row["comm_seconds_by_group"]["dp"] == pytest.approx(expected)
