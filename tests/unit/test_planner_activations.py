"""The planner's activation model for cluster shapes (parallel/planner/memory.py) against Korthikanti et
al. 2022 (arXiv 2205.05198), Table 2, and the pipeline bubble against the schedule's closed form.

Table 2 counts, per layer and microbatch, in 16-bit with 1-byte dropout masks, what a Megatron-LM GPT
saves for backward with materialized attention (the s x s scores in memory):

    tensor parallel                         s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel              s·b·h·(34 + 5·a·s/h)/t
    tensor parallel + selective             s·b·h·(10 + 24/t)
    tensor + sequence parallel + selective  s·b·h·34/t
    full recomputation                      2·s·b·h (each layer's input; Megatron checkpoints the
                                            sequence piece, 2·s·b·h/t, under sequence parallelism)

Its terms (§4.1) without dropout: the two residual dropouts' masks (2·s·b·h, over t with sequence
parallelism) and the attention dropout's mask and output (3·a·s²·b, over t) are not made, the softmax's
output (2·a·s²·b) stays: 10 -> 8, 34 -> 32, 5·a·s -> 2·a·s. run_plan.py refuses dropout under tp (the
sandbox's replicas would draw different masks), so launch.plan's GPT at tp 8 has none and is checked
against that form; memory.py itself is checked against the printed one on a shape with dropout.

Their GPT 22B (Table 3): 48 layers of width 6144, 64 heads, s = 2048, a microbatch of 4 sequences, tp 8,
on A100s, whose preset (conf/cluster/a100_80gb.yaml) says `flash_attention: false`. Under sequence
parallelism the column-parallel linears save the sequence piece (`parallel.tp_saves=sharded`), as
Megatron-LM does. Recomputation holds more than Table 2's stored tensors at one moment of backward: one
block's recomputed tensors (full: its whole set; selective: its core's scores beside the tensors that
block still holds), derived here from the same paper's terms.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import yaml
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT
from omegaconf import OmegaConf

from launch.config import CONFIG_DIR
from parallel import activations
from parallel.compose import theory as compose_theory
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.dist.dims import ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.planner import memory
from parallel.planner.cluster import cluster_from_config
from parallel.planner.one import evaluate_layout
from parallel.planner.timing import _pipeline_exposed
from parallel.pp.options import PPOptions
from parallel.pp.simulator import simulate_schedule, unit_costs
from parallel.registry import layout_of
from parallel.run_plan import build_plan
from parallel.sync.options import SyncOptions

S, B, H, A, L, T = 2048, 4, 6144, 64, 48, 8  # GPT 22B at tp 8, Korthikanti et al.'s Table 3
SBH = S * B * H


def table_2(sp: bool, recompute: str, dropout: bool = True) -> float:
    """Korthikanti et al.'s Table 2 (without dropout: less its mask terms), every layer of one microbatch on
    one of T ranks, in bytes."""
    scores = (5 if dropout else 2) * A * S / (H * T)
    masks = 2 if dropout else 0
    if recompute == "full":
        return L * SBH * 2 / (T if sp else 1)
    stored = (32 + masks) / T if sp else 8 + masks + 24 / T
    return L * SBH * (stored + (scores if recompute == "none" else 0))


def recomputed_block(sp: bool, recompute: str, dropout: bool = True) -> float:
    """What one block adds at the moment it is recomputed in backward, in the same paper's terms (§4.1):
    full, its whole set less its input (already kept); selective, its core's scores (softmax output 2as²b,
    with dropout its mask as²b and output 2as²b, over t) beside ln1's input 2sbh, the QKV GEMM's input
    2sbh (both over t under sequence parallelism) and Q, K, V 6sbh/t, less the block's stored tensors (the
    MLP's and the output projection's are freed by then)."""
    cut = T if sp else 1
    if recompute == "full":
        return table_2(sp, "none", dropout) / L - 2 * SBH / cut
    if recompute == "selective":
        before_core = SBH * (2 / cut + 2 / cut + 6 / T)
        scores = (5 if dropout else 2) * A * S * S * B / T
        return max(0.0, before_core + scores - table_2(sp, "selective", dropout) / L)
    return 0.0


def plan_row(cluster: str, overrides: list[str], recompute: str, flash: bool | None = None) -> dict:
    """launch.plan's one-layout row for GPT 22B on 8 GPUs of `cluster` (parallel=tp, tp 8)."""
    model = [f"model.n_layers={L}", f"model.d_model={H}", f"model.n_heads={A}", f"model.seq_len={S}",
             "model.vocab_size=51200"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=["model=gpt2_1p5b", f"cluster={cluster}", "parallel=tp",
                                                     "parallel.tp=8", *model, *overrides])
        base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    preset = OmegaConf.to_container(cfg.cluster, resolve=True)
    if flash is not None:
        preset["flash_attention"] = flash
    c = cluster_from_config(preset, None, 8)
    return evaluate_layout(shape, base, [], c, 8, B, OmegaConf.to_container(cfg.parallel, resolve=True), recompute, B)


SP = ["parallel.sequence_parallel=true", "parallel.tp_saves=sharded"]
GIB = 2**30


def test_gpt_22b_at_tp_8_on_a100s_holds_what_table_2_gives():
    """The issue's check: cluster=a100_80gb, train.recompute=none, GPT 22B at tp 8 (no dropout), within 2%
    of Table 2: 36.75 GiB, of which the scores 2as/(ht) = 5.3 units of sbh in 16.3 (without them: 24.75)."""
    row = plan_row("a100_80gb", [], "none")
    assert table_2(False, "none", dropout=False) / GIB == pytest.approx(36.75)
    assert row["memory_bytes_per_device"]["activations"] == pytest.approx(table_2(False, "none", False), rel=0.02)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True])
def test_every_recompute_mode_with_and_without_sequence_parallelism(sp, recompute):
    row = plan_row("a100_80gb", SP if sp else [], recompute)
    expected = table_2(sp, recompute, False) + recomputed_block(sp, recompute, False)
    assert row["memory_bytes_per_device"]["activations"] == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True])
def test_table_2_as_printed_on_a_shape_with_dropout(sp, recompute):
    """memory.py on GPT 22B with dropout (its masks 1 byte each), materialized attention: Table 2's rows."""
    shape = ModelShape(gpt=GPTConfig(vocab_size=51200, seq_len=S, n_layers=L, d_model=H, n_heads=A, dropout=0.1))
    layout = layout_of(ParallelDims.resolve(T, tp=T), microbatch_size=B, recompute=recompute, sequence_parallel=sp,
                       tp_saves="sharded" if sp else "gathered", precision="bf16")
    got = memory.implementation_activation_bytes(shape, layout, 2, flash_attention=False)
    assert got == [got[0]] * T
    assert got[0] == pytest.approx(table_2(sp, recompute) + recomputed_block(sp, recompute), rel=0.02)
    if recompute != "full":  # the stored tensors alone, to the byte: Table 2 leaves out nothing memory.py counts
        assert got[0] - recomputed_block(sp, recompute) == pytest.approx(table_2(sp, recompute), rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
def test_flash_attention_holds_no_scores(sp):
    """With a fused core (the H100 presets, or the A100's with flash_attention: true) nothing of size s²
    is saved: no recomputation holds what Table 2's selective row gives, and selective recomputation
    recomputes nothing that was saved."""
    expected = table_2(sp, "selective", False)
    for recompute in ("none", "selective"):
        for cluster, flash in (("a100_80gb", True), ("h100_sxm", None)):
            row = plan_row(cluster, SP if sp else [], recompute, flash)
            assert row["memory_bytes_per_device"]["activations"] == pytest.approx(expected, rel=0.02), cluster


TINY_LLAMA = GPTConfig(**yaml.safe_load((PROJECT_ROOT / "conf" / "model" / "tiny_llama.yaml").read_text()))


@pytest.mark.parametrize("cfg", [GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4), TINY_LLAMA],
                         ids=["gpt2_block", "tiny_llama"])
def test_the_units_are_the_sandboxs_formula_less_its_small_terms(cfg):
    """The sandbox GPT's own formula (parallel/activations.py, what every run's saved-tensor meter equals
    on the CPU, whose attention kernel is fused: on tiny_llama too, tests/unit/test_recompute.py) and the
    planner's units with flash attention count the same tensors: they differ by the norms' fp32 statistics
    (LayerNorm's mean and 1/std, RMSNorm's 1/rms) and the kernel's log-sum-exp alone, and for SwiGLU by
    silu(gate), which the sandbox keeps for its product's backward and Megatron's fused bias-SwiGLU
    recomputes (3 units of f, not 4)."""
    shape = ModelShape(gpt=cfg)
    per_norm = 2 if cfg.norm == "layernorm" else 1
    for t, sp, saves in ((1, False, "gathered"), (2, False, "gathered"), (2, True, "gathered"), (4, True, "sharded")):
        b = 2
        cut = layout_of(ParallelDims.resolve(t, tp=t), microbatch_size=b, sequence_parallel=sp, tp_saves=saves).cut()
        n = b * cfg.seq_len
        n_sp = n // t if sp else n
        statistics = 2 * per_norm * n_sp * activations.STAT_BYTES + b * (cfg.n_heads // t) * cfg.seq_len * 4
        silu = n * cfg.d_ff // t * 4 if cfg.gated_mlp else 0
        units = memory.block_units(shape, t, sp, 4, saves_shard=cut.saves_shard)
        assert activations.block_saved_bytes(cfg, cut) == n * units["layer"] + statistics + silu
        assert units["scores"] == 0


def test_the_scores_take_the_attention_dropouts_mask_where_there_is_dropout():
    """Materialized attention saves the softmax's output, w·a·s/t per token; with dropout also its 1-byte
    mask and its output: (2w + 1)·a·s/t, Korthikanti's 5·a·s/t in 16-bit."""
    for dropout, per_head in ((0.0, 2), (0.1, 5)):
        shape = ModelShape(gpt=GPTConfig(seq_len=S, n_layers=2, d_model=H, n_heads=A, dropout=dropout))
        units = memory.block_units(shape, T, False, 2, flash_attention=False)
        assert units["scores"] == per_head * A * S / T
        flash = memory.block_units(shape, T, False, 2)
        assert units["layer"] - flash["layer"] == units["scores"]


def test_the_bubble_is_the_schedules_with_the_unrounded_costs():
    """1F1B with free sends idles (p - 1)·(F + B) on every rank: the bubble the planner reports, to the
    float, for a backward/forward ratio that three digits would round (2.00449 -> 2.00)."""
    preset = yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "a100_80gb.yaml").read_text())
    cluster = cluster_from_config(preset, None, 4)
    p, m = 4, 64
    layout = layout_of(ParallelDims.resolve(p, pp=p), microbatches=m, schedule="1f1b")
    forward = 0.0123
    backward = forward * 2.00449
    _, bubble = _pipeline_exposed(layout, cluster, {}, {}, 1, forward, backward)
    assert bubble == pytest.approx((p - 1) * (forward + backward), rel=1e-9)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_bubble_runs_through_the_other_stages(schedule, v):
    """A last stage slower than the rest (it holds the head) sets the steady pace, but the fill and drain run
    through the other stages: the simulator, played with each rank's own costs, finishes at the slowest
    rank's m·(F + B) plus the bubble the planner reports with the others' times as `fill`, not the slowest's."""
    preset = yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "a100_80gb.yaml").read_text())
    cluster = cluster_from_config(preset, None, 4)
    p, m = 4, 16
    layout = layout_of(ParallelDims.resolve(p, pp=p), microbatches=m, schedule=schedule, virtual_stages=v)
    other, slow = (0.010, 0.030), (0.0115, 0.0335)
    costs = {(r, c): unit_costs(*(slow if r == p - 1 else other)) for r in range(p) for c in range(v)}
    played = simulate_schedule(schedule, p, m, v, costs).makespan
    _, bubble = _pipeline_exposed(layout, cluster, {}, {}, 1, *slow, other)
    _, slowest_only = _pipeline_exposed(layout, cluster, {}, {}, 1, *slow)
    assert m * sum(slow) + bubble == pytest.approx(played, rel=1e-9)
    assert slowest_only > bubble


# -- Llama's block: the planner's figures are the registry's, which the runs equal -----------------------------
LLAMA_LAYOUTS = [
    # world, parallel overrides, recompute
    (1, ["parallel=single"], "none"),
    (1, ["parallel=single"], "selective"),
    (1, ["parallel=single"], "full"),
    (2, ["parallel=dp"], "selective"),
    (2, ["parallel=zero3"], "none"),
    (4, ["parallel=zero2"], "full"),
    (2, ["parallel=pp_1f1b", "parallel.microbatches=4"], "none"),
    (4, ["parallel=pp_gpipe", "parallel.dp=2", "parallel.microbatches=2"], "none"),
    (2, ["parallel=tp"], "none"),
    (4, ["parallel=tp_sp", "parallel.tp=4", "parallel.tp_saves=sharded"], "none"),  # tp 4 > 2 kv heads
]


@pytest.mark.parametrize("model", ["tiny_llama", "small_llama"])
@pytest.mark.parametrize("world,overrides,recompute", LLAMA_LAYOUTS)
def test_the_planners_llama_figures_are_the_registrys(model, world, overrides, recompute):
    """On an fp32 cluster the planner's saved bytes and model state of every stage, for Llama's block, are
    the registry's formulas (parallel/activations.py, parallel/model_state.py), the ones every run's
    meter and tensors are held to (summary memory.activations_match_theory and matches_formula); its
    bytes per step are the registry's closed form, unscaled (an untied head)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", *overrides, f"train.recompute={recompute}"])
    plan = build_plan(cfg, LaunchEnv(world_size=world, local_world_size=world), cuda_available=False)
    gpt = GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    preset = {**yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "this_machine.yaml").read_text()),
              "peak_tflops": 1.0, "loopback_gbytes_per_s": 1.0, "loopback_latency_us": 10.0,
              "codec_gbytes_per_s": 1.0}  # nothing measured
    row = evaluate_layout(ModelShape(gpt=gpt), OmegaConf.to_container(cfg, resolve=True), [],
                          cluster_from_config(preset, None, world), world, cfg.train.global_batch,
                          OmegaConf.to_container(cfg.parallel, resolve=True), recompute)
    layout, dims = plan.layout, plan.dims
    expected = plan.spec.activations(gpt, layout)
    assert expected is not None and len(set(expected)) <= dims.pp
    pipeline = layout.of(PPOptions)
    for r, stage in enumerate(row["memory_by_stage"]):
        assert stage["activations"] == expected[dims.rank_of(r, 0, 0)], r
        state = plan.spec.model_state(gpt, layout) or compose_theory.combined_model_state_bytes(
            gpt, dims, r, layout.of(SyncOptions).zero, pipeline.virtual_stages, pipeline.layers,
            schedule=pipeline.schedule)
        assert (stage["params"], stage["grads"], stage["optimizer"]) == \
            (state["param_bytes"], state["grad_bytes"], state["optimizer_bytes"]), r
    assert Fraction(row["bytes_exact"] or 0) == Fraction(plan.spec.comm(gpt, layout)["sent_bytes_per_step_exact"])


def test_k_and_v_per_rank_are_the_ranks_kv_heads():
    """tiny_llama's 2 kv heads: split at t = 2, each replicated on two ranks at t = 4 (one head's width)."""
    gpt = TINY_LLAMA
    for t, kv_heads in ((1, 2), (2, 1), (4, 1)):
        cut = layout_of(ParallelDims.resolve(t, tp=t), microbatch_size=2).cut()
        n = 2 * gpt.seq_len
        assert activations.block_terms(gpt, cut)["qkv"] == n * (gpt.d_model // t + 2 * kv_heads * gpt.head_dim) * 4


def test_recomputation_under_a_split_backward_holds_its_rerun_beside_the_kept_graph():
    """ZB-H1 over 2 stages, 2 microbatches, selective recomputation with the scores materialized. Rank 1
    runs F B F B W W: its second B reruns a core while both microbatches' chunks are held (B frees nothing
    before W), 2c + the scores; rank 0 runs F F B W B W, where B does nothing and W is a whole backward,
    whose rerun core holds nothing beyond what the block has freed by then: 2c. Under 1F1B rank 1 holds
    one chunk (F B F B)."""
    shape = ModelShape(gpt=GPTConfig(vocab_size=51200, seq_len=S, n_layers=L, d_model=H, n_heads=A))
    units = memory.block_units(shape, T, False, 2, flash_attention=False)
    tokens = S * B
    chunk = (units["layer"] - units["scores"]) * tokens * L // 2
    scores = units["scores"] * tokens
    for schedule, expected in (("zbh1", [2 * chunk, 2 * chunk + scores]), ("1f1b", [2 * chunk, chunk])):
        layout = layout_of(ParallelDims.resolve(2 * T, tp=T, pp=2), microbatch_size=B, microbatches=2,
                           recompute="selective", schedule=schedule, precision="bf16")
        got = memory.implementation_activation_bytes(shape, layout, 2, flash_attention=False)
        assert got[::T] == pytest.approx(expected, rel=1e-9), schedule


def test_full_recomputation_leaves_a_split_backward_no_weight_half_to_defer():
    """A recomputed block runs its whole backward inside B (parallel/core/recompute.py), so under full
    recomputation ZB-H1's W has nothing to fill the bubble with: timed as 1F1B's step."""
    def makespan(schedule: str, recompute: str) -> float:
        layout = layout_of(ParallelDims.resolve(4, pp=4), microbatches=8, recompute=recompute, schedule=schedule)
        return compose_theory.pipeline_makespan(layout, 1.0, 2.0, 0.0)

    assert makespan("zbh1", "full") == makespan("1f1b", "full") == 33.0
    assert makespan("zbh1", "selective") == 27.0 < makespan("1f1b", "selective")
