"""The planner (parallel/planner/, launch/plan.py) without training: its counts against the closed forms,
its enumeration against run_plan.py, its bytes per link class against theory's totals, its time model
on a synthetic profile worked out by hand; the command line: test_planner_cli.py.

Activation memory against measured runs: test_planner_memory.py; predictions against runs:
test_planner_validate.py.
"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
import yaml
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT
from omegaconf import OmegaConf
from options import option

from launch.config import CONFIG_DIR
from parallel import algebra
from parallel.compose import theory as compose_theory
from parallel.core.shape import ModelShape
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.dp.theory import dp_comm
from parallel.layout import Layout
from parallel.planner import memory
from parallel.planner.cluster import Cluster, ClusterError, cluster_from_config
from parallel.planner.enumerate import Space, _key, _requests, candidate_of, enumerate_layouts, shape_rule, zero_stage
from parallel.planner.links import group_span
from parallel.planner.predict import predict_row
from parallel.planner.timing import forward_flops_per_token, step_time
from parallel.planner.traffic import bytes_by_link, layout_traffic
from parallel.registry import REGISTRY, StrategySpec, layout_of, register
from parallel.report.mfu import flops_per_token
from parallel.run_plan import build_plan, model_config
from parallel.sync import all_reduce_sync
from parallel.zero.theory import zero_model_state_bytes


def preset(name: str) -> dict:
    return yaml.safe_load((PROJECT_ROOT / "conf" / "model" / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def base() -> dict:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config", overrides=["model=tiny"]), resolve=True)


# -- the model description -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "small", "gpt2"])
def test_gpt2_shapes_count_what_theory_counts(name):
    shape = ModelShape.from_preset(preset(name))
    cfg = shape.gpt
    assert shape.differences() == []
    assert shape.parameter_count() == algebra.parameter_count(cfg)
    assert shape.flops_per_token() == flops_per_token(cfg)
    for t in (1, 2, 4):
        for layers, first, last in ((cfg.n_layers, True, True), (1, True, False), (2, False, True), (1, False, False)):
            assert shape.stage_parameters(t, layers, first, last, 2) == \
                compose_theory.stage_shard_parameter_count(cfg, t, layers, first, last)


def test_planner_shapes_count_their_published_sizes():
    """Llama 3 8B/70B/405B (Dubey et al. 2024: 8.03B, 70.6B, 405.9B) and GPT-2 124M and 1.5B, tied."""
    sizes = {"llama3_8b": 8.03e9, "llama3_70b": 70.55e9, "llama3_405b": 405.85e9, "gpt2_124m": 124.5e6,
             "gpt2_1p5b": 1.558e9}
    for name, size in sizes.items():
        shape = ModelShape.from_preset(preset(name))
        assert shape.differences()
        assert abs(shape.parameter_count() - size) < 0.002 * size, (name, shape.parameter_count())


def test_launch_train_builds_a_llama_shape_as_the_planner_reads_it():
    llama = model_config(OmegaConf.create(preset("llama3_8b")))
    assert ModelShape(gpt=llama) == ModelShape.from_preset(preset("llama3_8b"))
    assert (llama.kv_heads, llama.gated_mlp, llama.norm, llama.rope) == (8, True, "rmsnorm", True)
    assert model_config(OmegaConf.create(preset("small"))).n_layers == 8


def test_model_state_equals_theory_for_every_stage_and_zero_stage():
    shape = ModelShape.from_preset(preset("tiny"))
    cfg = shape.gpt
    for dp, tp, pp in ((8, 1, 1), (4, 2, 1), (2, 2, 2), (2, 1, 4), (1, 4, 2)):
        dims = ParallelDims(world_size=8, dp=dp, tp=tp, pp=pp)
        for zero in ((0, 1, 2) if dp > 1 else (0,)):
            layout = layout_of(dims, zero=zero)
            for r in range(pp):
                mine = memory.model_state_bytes(shape, layout, zero, "fp32", r)
                want = compose_theory.combined_model_state_bytes(cfg, dims, r, zero)
                assert (mine["params"], mine["grads"], mine["optimizer"]) == \
                    (want["param_bytes"], want["grad_bytes"], want["optimizer_bytes"]), (dp, tp, pp, zero, r)
    for stage in (1, 2, 3):
        layout = Layout(dims=ParallelDims(world_size=4, dp=4))
        mine = memory.model_state_bytes(shape, layout, stage, "fp32", 0)
        want = zero_model_state_bytes(cfg, layout, stage)
        assert (mine["params"], mine["grads"], mine["optimizer"]) == \
            (want["param_bytes"], want["grad_bytes"], want["optimizer_bytes"])


# -- the enumeration ---------------------------------------------------------------------------------------
SMALL_SPACE = Space(zero=(0, 2, 3), sequence_parallel=(False, True), schedules=("1f1b", "interleaved_1f1b"),
                    virtual_stages=(1, 2), max_microbatches=4)


def test_enumeration_refuses_exactly_what_plan_py_refuses(base):
    """Every request of the search space goes through build_plan with the DictConfig launch.train
    composes; the layouts it accepts (deduplicated as the planner does) are exactly the planner's."""
    shape = ModelShape.from_preset(preset("tiny"))
    world, batch = 4, 8
    found = enumerate_layouts(shape, base, world, batch, SMALL_SPACE)
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    accepted, refused = set(), 0
    has_recompute = "recompute" in base["train"]
    for spec in [s for s in REGISTRY.values() if "baseline" not in s.tags]:
        for request, _ in _requests(spec, world, batch, SMALL_SPACE, has_recompute, shape.gpt):
            cfg = OmegaConf.create(base)
            cfg.train.global_batch = batch
            cfg.parallel.name, cfg.parallel.grad_sync = spec.name, "bucketed"
            for k, v in request.items():
                if k == "recompute":
                    cfg.train.recompute = v
                else:
                    cfg.parallel[k] = v
            try:
                plan = build_plan(cfg, env, cuda_available=False)
            except ValueError as e:
                if "grad_sync" not in str(e):
                    refused += 1
                    continue
                cfg.parallel.grad_sync = "naive"
                plan = build_plan(cfg, env, cuda_available=False)
            accepted.add(_key(candidate_of(spec.name, plan, request)))
    assert {_key(c) for c in found.candidates} == accepted
    assert sum(found.refused.values()) == refused > 0
    # The rules that refused them are run_plan.py's own, in its words.
    assert any("which the interleaved schedule needs" in r for r in found.refused)
    assert any(r.startswith("parallel.zero=N does not compose with parallel.tp") for r in found.refused)


def test_enumeration_adds_the_kv_heads_rule_and_routes_through_the_registry(base):
    """A grouped-query shape splits its kv heads over tp or replicates them (tp 4 over 2 kv heads), and
    refuses a tp that does neither; pure-dp ZeRO-k runs as zero<k>; tp with pipeline stages as 3d; every
    candidate has one of the registry's strategies."""
    model = {**preset("tiny"), "n_kv_heads": 2, "gated_mlp": True, "ffn_hidden": 192}
    found = enumerate_layouts(ModelShape.from_preset(model), base, 4, 8, SMALL_SPACE)
    assert not any("n_kv_heads" in r for r in found.refused)
    assert any(c.layout.dims.tp == 4 for c in found.candidates)
    twelve = ModelShape.from_preset({**model, "d_model": 96, "n_heads": 12, "n_kv_heads": 4})
    refusal = shape_rule(twelve, SimpleNamespace(dims=ParallelDims.resolve(6, tp=6)))
    assert "model.n_kv_heads=4 and parallel.tp=6" in refusal and "\n" not in refusal
    assert shape_rule(twelve, SimpleNamespace(dims=ParallelDims.resolve(8, tp=8))) is None
    strategies = {(c.plan.strategy, c.layout.dims.tp > 1, c.layout.dims.pp > 1, c.zero) for c in found.candidates}
    assert ("zero3", False, False, 3) in strategies and ("3d", True, True, 0) in strategies
    assert all(c.plan.strategy in REGISTRY for c in found.candidates)
    # The ZeRO stage a row reports is the one that runs: in the name for zero<k> and HSDP's pair, else
    # parallel.zero.
    named = {"zero1": 1, "zero2": 2, "zero3": 3, "hsdp_zero2": 2, "hsdp": 3}
    for c in found.candidates:
        assert c.zero == named.get(c.plan.strategy, option(c.plan, "zero"))
    combined = [c for c in found.candidates if c.layout.dims.dp > 1 and c.layout.dims.pp > 1]
    assert {c.zero for c in combined} == {0, 2} and {c.plan.strategy for c in combined if c.zero} == {"3d"}


def test_a_strategy_registered_without_an_activation_formula_gets_rows_saying_so(base):
    """A new registry entry enters the search with its layout rules; with no activation formula its
    rows keep the bytes and the time but say that memory is not known (fits: null)."""
    spec = register(StrategySpec(name="planner_toy", description="dp without an activation formula",
                                 build=lambda model, plan, ctx: None, comm=dp_comm, min_world=2))
    try:
        shape = ModelShape.from_preset(preset("tiny"))
        found = enumerate_layouts(shape, base, 2, 8, SMALL_SPACE, only=["planner_toy"])
        assert found.candidates and all(c.plan.strategy == spec.name for c in found.candidates)
        row = predict_row(shape, found.candidates[0], synthetic_cluster(), "planner_toy")
        assert row["fits"] is None and row["memory_bytes_per_device"]["activations"] is None
        assert "no activation formula" in row["notes"][0] and row["bytes_per_step"] is not None
        # What is known is a lower bound: model state alone beyond the device does not fit, formula or not.
        state = sum(row["memory_bytes_per_device"][k] for k in ("params", "grads", "optimizer"))
        tight = predict_row(shape, found.candidates[0], synthetic_cluster(memory_bytes=state // 2), "planner_toy")
        assert tight["fits"] is False and tight["over_bytes"] > 0
    finally:
        del REGISTRY["planner_toy"]


def test_a_mixture_of_experts_gets_the_registrys_model_state_per_rank():
    """MoE layouts: the model state per rank is the registry's formula, the one every ep and dp run's
    memory is checked against (E/ep experts on an ep rank, every expert under dp)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        moe_base = OmegaConf.to_container(compose(config_name="config", overrides=["model=tiny_moe"]), resolve=True)
    shape = ModelShape.from_preset(preset("tiny_moe"))
    found = enumerate_layouts(shape, moe_base, 4, 8, SMALL_SPACE, only=["dp", "ep"])
    rows = {(c.plan.strategy, c.layout.dims.ep): predict_row(shape, c, synthetic_cluster(), None)
            for c in found.candidates if c.layout.microbatches == 1}
    assert {("dp", 1), ("ep", 2), ("ep", 4)} <= set(rows)
    for (name, ep), row in rows.items():
        c = next(c for c in found.candidates if (c.plan.strategy, c.layout.dims.ep) == (name, ep))
        figures = c.plan.spec.model_state(shape.gpt, c.layout)
        memory = row["memory_bytes_per_device"]
        assert (memory["params"], memory["grads"], memory["optimizer"]) == (
            figures["param_bytes"], figures["grad_bytes"], figures["optimizer_bytes"])
    held = {key: row["memory_bytes_per_device"]["params"] for key, row in rows.items()}
    assert held[("ep", 4)] < held[("ep", 2)] < held[("dp", 1)]


# -- bytes by link class ---------------------------------------------------------------------------------------
def _traffic(base, name: str, dims: ParallelDims, algorithm: str, gpus_per_node: int = 4, **options):
    shape = ModelShape.from_preset(preset("tiny"))
    env = LaunchEnv(rank=0, world_size=dims.world_size, local_rank=0, local_world_size=dims.world_size)
    cfg = OmegaConf.create(base)
    cfg.parallel.update(name=name, dp=dims.dp, tp=dims.tp, pp=dims.pp, cp=dims.cp, **options)
    plan = build_plan(cfg, env, cuda_available=False)
    zero = zero_stage(plan.strategy, plan)
    traffic = layout_traffic(plan.spec, shape, plan.layout, zero, gpus_per_node, algorithm,
                             memory.rank_layers(shape, plan.layout))
    return plan, traffic


def test_the_dp_groups_gathers_are_zeros_own_whatever_tp_gathers(base):
    """The dp group's all-gathers (ZeRO's parameters, timed apart from its reductions) are theory's count for
    that group: the tp group's re-gathers of the saved sequence pieces are not among them."""
    dims, options = ParallelDims(4, 2, tp=2), dict(zero=2, sequence_parallel=True, microbatches=2)
    gathered = _traffic(base, "3d", dims, "ring", **options)[1]
    sharded = _traffic(base, "3d", dims, "ring", tp_saves="sharded", **options)[1]
    assert sharded["tp"].total > gathered["tp"].total  # the re-gathers
    assert sharded["dp"].gathers == gathered["dp"].gathers == gathered["dp"].total / 3  # m + 1 = 3 dp collectives


def test_bytes_per_link_class_split_theorys_total_exactly(base):
    """8 ranks on 2 nodes of 4: the two classes sum to the closed form's figure to the byte, and each group
    crosses nodes as its ranks sit (tp innermost, pp outermost)."""
    for name, dims, options in (("dp", ParallelDims(8, 8), {}), ("zero3", ParallelDims(8, 8), {}),
                                ("tp", ParallelDims(8, 2, 4), {}), ("3d", ParallelDims(8, 2, 2, 2), {}),
                                ("pp", ParallelDims(8, 2, 1, 4), {"microbatches": 4}),
                                ("3d", ParallelDims(8, 1, 4, 2), {"sequence_parallel": True, "microbatches": 4})):
        for algorithm in ("ring", "hierarchical"):
            plan, traffic = _traffic(base, name, dims, algorithm, **options)
            links = bytes_by_link(traffic)
            theory_total = Fraction(plan.spec.comm(plan.model, plan.layout)["sent_bytes_per_step_exact"])
            exact = sum((t.total for t in traffic.values()), Fraction(0))
            assert exact == theory_total and links["intra_node"] + links["inter_node"] == pytest.approx(float(exact))
    # dp over 8 ranks on 2 nodes: a ring crosses on 2 of its 8 edges; hierarchically (k-1)/(N-1) = 1/7.
    _, ring = _traffic(base, "dp", ParallelDims(8, 8), "ring")
    _, tree = _traffic(base, "dp", ParallelDims(8, 8), "hierarchical")
    assert ring["dp"].inter == ring["dp"].total / 4 and tree["dp"].inter == tree["dp"].total / 7
    # tp 4 inside a node never crosses; its dp pair (rank i and i + 4) always does.
    _, tp = _traffic(base, "tp", ParallelDims(8, 2, 4), "ring")
    assert tp["tp"].inter == 0 and tp["dp"].inter == tp["dp"].total
    # pp 2 x tp 4: the stages are the nodes, so every activation crosses; 4 flows leave a node each way.
    _, p3 = _traffic(base, "3d", ParallelDims(8, 1, 4, 2), "ring", sequence_parallel=True, microbatches=4)
    assert p3["pp"].inter == p3["pp"].total and p3["tp"].inter == 0 and p3["pp"].span.flows_per_node == 4
    # Interleaved: virtual stages 0->1->2->3 on ranks 0,1,0,1 of two nodes: every boundary crosses.
    span = group_span(ParallelDims(2, 1, 1, 2), "pp", 1, "ring", 2)
    assert span.inter_fraction == 1 and span.size == 2


# -- the time model on a synthetic profile -----------------------------------------------------------------
def synthetic_cluster(**changes) -> Cluster:
    """1 TFLOP/s reached in full, 1 GB/s inside a node, 0.1 GB/s between, no latency, 4 per node."""
    fields = dict(name="synthetic", gpus_per_node=4, memory_bytes=2**30, peak_flops=1e12, efficiency=1.0,
                  intra_bytes_per_s=1e9, inter_bytes_per_s=1e8, intra_latency_s=0.0, inter_latency_s=0.0,
                  precision="fp32", algorithm="hierarchical", p2p_overlap=True)
    return Cluster(**{**fields, **changes})


def _time(base, name, dims, cluster, **options):
    shape = ModelShape.from_preset(preset("tiny"))
    plan, traffic = _traffic(base, name, dims, cluster.algorithm, cluster.gpus_per_node, **options)
    zero = zero_stage(plan.strategy, plan)
    grad_sync = option(plan, "grad_sync") if all_reduce_sync(plan.layout, plan.spec) and not zero else None
    layers = memory.rank_layers(shape, plan.layout)
    return shape, plan, traffic, step_time(shape, plan.layout, zero, grad_sync, cluster, traffic, layers, 4)


def test_compute_sums_to_the_mfu_count():
    """Forward FLOPs on every rank of every stage, times 3 (backward twice forward), are the MFU
    convention's 6·N + 12·L·h·s per token."""
    shape = ModelShape.from_preset(preset("tiny"))
    for t, layers in ((1, [4]), (2, [2, 2]), (4, [1, 3])):
        total = sum(forward_flops_per_token(shape, t, n, r == len(layers) - 1) for r, n in enumerate(layers)) * t * 3
        assert total == pytest.approx(shape.flops_per_token(), rel=1e-3)  # norms replicated over tp: < 0.1%


def test_context_parallel_ranks_compute_their_share_of_the_sequence(base):
    """Under cp each rank runs b·s/cp tokens of each microbatch (its linears' rows, its queries against every
    key): dp 2 x cp 2 holds as many tokens per rank as dp 4 and computes as long on the FLOP count, and on a
    GPU's roofline the step's FLOPs summed over ranks are dp 4's, for either kind of cp; its pipeline's messages
    are its own s/cp tokens'."""
    flat = _time(base, "dp", ParallelDims(4, 4), synthetic_cluster())[3]
    split = _time(base, "cp", ParallelDims(4, 2, cp=2), synthetic_cluster())[3]
    assert split.compute == pytest.approx(flat.compute) and split.forward == pytest.approx(flat.forward)
    gpu = cluster_from_config(yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "a100_80gb.yaml").read_text()),
                              None, world=4)
    flat = _time(base, "dp", ParallelDims(4, 4), gpu)[3]
    for kind in ("cp", "cp_a2a"):
        split = _time(base, kind, ParallelDims(4, 2, cp=2), gpu)[3]
        assert split.model_flops == pytest.approx(flat.model_flops), kind
        assert split.hardware_flops == pytest.approx(flat.hardware_flops), kind
    # A stage boundary carries this rank's b·(s/cp)·h: one latency per such message (1 ms here, 4 ranks in a node).
    slow = synthetic_cluster(intra_latency_s=1e-3, inter_latency_s=1e-3)
    _, plan, traffic, t = _time(base, "cp", ParallelDims(4, 1, pp=2, cp=2), slow, microbatches=2)
    boundary = plan.layout.microbatch_size * (32 // 2) * 64 * 4
    sent = traffic["pp"].per_rank(4)
    assert t.comm_by_group["pp"] == pytest.approx(sent / 1e9 + sent / boundary * 1e-3)


def test_time_model_by_hand(base):
    """Each rule of the time model, checked against the number worked out by hand."""
    cluster = synthetic_cluster()
    s = 32  # tiny's sequence
    # dp 4 on one node, one bucket (0.9 MB of gradients < 25 MiB): the last bucket is the whole
    # all-reduce, so none of it hides; the step is compute + bytes / rate.
    shape, plan, traffic, t = _time(base, "dp", ParallelDims(4, 4), cluster)
    b = plan.layout.microbatch_size
    forward = b * s * forward_flops_per_token(shape, 1, 4, True) / 1e12
    dp_seconds = 2 * 3 / 4 * algebra.parameter_count(plan.model) * 4 / 1e9
    assert t.compute == pytest.approx(3 * forward) and t.bubble == 0
    assert t.exposed_comm == pytest.approx(dp_seconds) and t.total == pytest.approx(3 * forward + dp_seconds)
    # ZeRO-1: the reduce-scatter waits for the schedule and the all-gather for the step: all exposed, the
    # same bytes as dp's all-reduce.
    _, _, _, z1 = _time(base, "zero1", ParallelDims(4, 4), cluster)
    assert z1.exposed_comm == pytest.approx(dp_seconds)
    # tp 4 inside a node: its collectives block forward and backward, every byte at the in-node rate.
    shape, plan, traffic, t = _time(base, "tp", ParallelDims(4, 1, 4), cluster)
    assert t.exposed_comm == pytest.approx(traffic["tp"].per_rank(4) / 1e9)
    # 1F1B over 4 stages on 2 nodes of 2, m = 8: the last stage (a block and the head) sets the pace, and
    # the fill and drain run through the other three (a block each): the bubble is 3·(F + B) of theirs,
    # less than of the last stage's; the sends hide but for those on the fill and drain path, stage 0 -> 3
    # and back: 2 boundaries inside a node, 1 between, each way.
    two = synthetic_cluster(gpus_per_node=2)
    shape, plan, traffic, t = _time(base, "pp", ParallelDims(4, 1, 1, 4), two, microbatches=8)
    other = plan.layout.microbatch_size * s * forward_flops_per_token(shape, 1, 1, False) / 1e12
    assert t.bubble == pytest.approx(3 * (other + 2 * other), rel=1e-3) and t.bubble < 3 * (t.forward + t.backward)
    boundary = plan.layout.microbatch_size * s * 64 * 4
    assert t.exposed_comm == pytest.approx(2 * (2 * boundary / 1e9 + boundary / 1e8))
    # On gloo (sends on the sender's path) the simulator plays each send: more exposed, never less.
    _, _, _, gloo = _time(base, "pp", ParallelDims(4, 1, 1, 4), synthetic_cluster(gpus_per_node=2, p2p_overlap=False),
                          microbatches=8)
    assert gloo.exposed_comm > t.exposed_comm and gloo.bubble == pytest.approx(t.bubble)


def test_tp_backward_overlap_hides_the_column_parallel_reductions(base):
    """Where the framework overlaps backward's tp collectives (Megatron-LM's asynchronous all-reduce), each block's
    two column-parallel input-gradient all-reduces leave the exposed time: 2 of its 4 tensors (tp 4 in a node, no
    recomputation); the row-parallel ones and everything else are as before."""
    shape, plan, traffic, t = _time(base, "tp", ParallelDims(4, 1, 4), synthetic_cluster())
    _, _, _, hidden = _time(base, "tp", ParallelDims(4, 1, 4), synthetic_cluster(tp_backward_overlap=True))
    g, b = shape.gpt, plan.layout.microbatch_size
    all_reduce = 2 * 3 / 4 * b * g.seq_len * g.d_model * 4 / 1e9
    assert t.exposed_comm - hidden.exposed_comm == pytest.approx(g.n_layers * 2 * all_reduce)
    assert hidden.exposed_comm > 0 and hidden.compute == t.compute and hidden.comm_by_group == t.comm_by_group


def test_this_machine_takes_the_emulated_networks_settings():
    """The emulated network's net.* settings: 2 nodes of 2 ranks behind 200 Mbit/s links with 1 ms latency; the
    machine's memory and peak shared by every rank; a world the network does not have is refused."""
    preset = {**yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "this_machine.yaml").read_text()),
              "peak_tflops": 0.3, "loopback_gbytes_per_s": 1.0, "loopback_latency_us": 100, "codec_gbytes_per_s": 2.0}
    net = {"nodes": 2, "procs_per_node": 2, "inter_mbit": 200, "intra_mbit": None, "latency_ms": 1, "loss_pct": 0}
    c = cluster_from_config(preset, net, world=4)
    assert (c.nodes, c.gpus_per_node, c.node_link_shared, c.shared_compute) == (2, 2, True, True)
    assert c.inter_bytes_per_s == 200e6 / 8 and c.intra_bytes_per_s == 1e9 and c.codec_bytes_per_s == 2e9
    assert c.inter_latency_s == pytest.approx(100e-6 + 1e-3) and c.memory_bytes == pytest.approx(23.4 * 2**30 / 4)
    assert c.flops_per_rank(4) == pytest.approx(0.3e12 * preset["efficiency"] / 4) and c.peak_for_mfu(4) == 0.3e12
    with pytest.raises(ClusterError, match="plan.world=8 but the network has net.nodes x net.procs_per_node = 2 x 2"):
        cluster_from_config(preset, net, world=8)


# -- one layout ----------------------------------------------------------------------------------------------
def test_one_layout_is_the_searchs_row_for_it(base):
    """parallel=<preset> with its overrides: the same row the search ranks for that layout (memory, bytes, time),
    and run_plan.py's refusal where a run would meet one."""
    from parallel.planner.one import evaluate_layout
    from parallel.planner.search import plan_rows

    shape, cluster = ModelShape.from_preset(preset("tiny")), synthetic_cluster()
    parallel = {**base["parallel"], "name": "3d", "tp": 2, "pp": 2, "microbatches": 4, "schedule": "1f1b",
                "virtual_stages": 1, "zero": 0, "sequence_parallel": False, "dp": None, "cp": 1, "ep": 1}
    row = evaluate_layout(shape, base, [], cluster, 8, 16, parallel)
    space = Space(recompute=("none",), schedules=("1f1b",), virtual_stages=(1,))
    rows, _ = plan_rows(shape, base, [], cluster, 8, 16, space, ["3d"])
    same = [r for r in rows if r["layout"] == row["layout"]]
    assert len(same) == 1 and (row["layout"]["dp"], row["layout"]["tp"], row["layout"]["pp"]) == (2, 2, 2)
    for key in ("memory_bytes_per_device", "bytes_exact", "step_time_s", "fits", "mfu"):
        assert row[key] == same[0][key], key
    with pytest.raises(LayoutError, match="not divisible by parallel.dp x parallel.microbatches"):
        evaluate_layout(shape, base, [], cluster, 8, 16, {**parallel, "microbatches": 3})
