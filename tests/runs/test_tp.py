"""Tensor parallelism (with sequence parallelism, and composed with data parallelism) against the single run.

Each case trains the tiny model (GPT-2's block, or Llama's: conf/model/tiny_llama.yaml, 2 K/V heads
for 4 query heads, so tp = 4 holds each kv head on two ranks) for 6 steps under torchrun on gloo
and checks:
  * per-step losses within 1e-5 relative of the single-process run, the same final parameters
    (gathered from the shards) and the same data;
  * step 0's full-model gradients (gathered, after every sync) equal the single run's, and every
    replicated gradient is identical on all tp ranks (complete, not partial), the K/V heads that
    several tp ranks share too;
  * the bytes per step equal parallel/tp/theory.py exactly, and docs/theory/tensor-parallel.md's closed form written
    out here a second time;
  * the Megatron count per layer, read off summary.json's comm.by_tag_op and metrics.jsonl;
  * the bytes saved for backward, measured on every rank, equal parallel/activations.py's formula
    exactly; with parallel.tp_saves=sharded (the column-parallel linears keep their input's sequence
    piece and gather it again in backward) the 2L + 1 regathers are in the bytes and the saved
    bytes are (2L + 1)·b·s·h·(t-1)/t elements fewer than the gathered mode's formula, written out here.
"""

from fractions import Fraction

import pytest
from launcher import TINY, TINY_LLAMA, assert_ok, check_matches_single, check_step0_grads_match
from observability import check_time_breakdown, check_trace

from parallel.activations import registry_activations
from parallel.core.model import GPTConfig
from parallel.dist.dims import ParallelDims
from parallel.registry import layout_of

L, H, S = 4, 64, 32  # the tiny models: layers, width, sequence length (conf/model/tiny.yaml, tiny_llama.yaml)
GLOBAL_BATCH = 16
KV_HEADS, HEAD_DIM = 2, 16  # tiny_llama's K/V heads and head size
MODELS = {  # the overrides, the single run's fixture, the config
    "tiny": (TINY, "single_run", GPTConfig(seq_len=S, n_layers=L, d_model=H, n_heads=4)),
    "tiny_llama": (TINY_LLAMA, "single_run_llama",
                   GPTConfig(seq_len=S, n_layers=L, d_model=H, n_heads=4, n_kv_heads=KV_HEADS, ffn_hidden=192,
                             gated_mlp=True, norm="rmsnorm", position_embedding="rope", bias=False)),
}

SHARDED = "parallel.tp_saves=sharded"
LLAMA = "model=tiny_llama"  # a case on MODELS["tiny_llama"]
CASES = [
    # id, world, overrides, tp, dp, sequence parallel, microbatches
    ("tp2", 2, ["parallel=tp"], 2, 1, False, 1),
    ("tp4-mb2", 4, ["parallel=tp", "parallel.tp=4", "parallel.microbatches=2"], 4, 1, False, 2),
    ("tp_sp2-mb2", 2, ["parallel=tp_sp", "parallel.microbatches=2"], 2, 1, True, 2),
    ("tp_sp4", 4, ["parallel=tp_sp", "parallel.tp=4"], 4, 1, True, 1),
    ("dp2xtp2-mb2", 4, ["parallel=tp", "parallel.microbatches=2", "parallel.bucket_mb=0.1"], 2, 2, False, 2),
    ("dp2xtp_sp2-naive", 4, ["parallel=tp_sp", "parallel.grad_sync=naive"], 2, 2, True, 1),
    # The column-parallel linears save the sequence piece (parallel.tp_saves=sharded).
    ("tp_sp2-sharded-mb2", 2, ["parallel=tp_sp", SHARDED, "parallel.microbatches=2"], 2, 1, True, 2),
    ("tp_sp4-sharded", 4, ["parallel=tp_sp", "parallel.tp=4", SHARDED], 4, 1, True, 1),
    ("dp2xtp_sp2-sharded", 4, ["parallel=tp_sp", SHARDED], 2, 2, True, 1),
    # Llama's block: tp 4 over 2 K/V heads (each held by two ranks, their gradients summed over tp),
    # with and without sequence parallelism, and tp 2 splitting them, under dp.
    ("llama-tp4-mb2", 4, [LLAMA, "parallel=tp", "parallel.tp=4", "parallel.microbatches=2"], 4, 1, False, 2),
    ("llama-tp_sp4-sharded", 4, [LLAMA, "parallel=tp_sp", "parallel.tp=4", SHARDED], 4, 1, True, 1),
    ("llama-dp2xtp2", 4, [LLAMA, "parallel=tp"], 2, 2, False, 1),
]


def check_grads_match_single(run, single_run, llama=False, t=1):
    mine = check_step0_grads_match(run, single_run)
    # Replicated parameters (norms, row-parallel biases, positions) must hold the complete gradient
    # on every tp rank. Bitwise: every rank computes them from identical numbers (all-reduce
    # results are identical on all ranks). Under sequence parallelism this is what the
    # once-per-step `tp/sp_grads` all-reduce restores; without it they are complete as they stand.
    # K and V heads shared by t/kv ranks: each rank's part summed by `tp/kv_grads`.
    spread = mine["tp_replica_max_diff"]
    replicated = ["blocks.0.ln1.weight"] + ([] if llama else ["embed.pos.weight", "blocks.0.attn.proj.bias"])
    shared_kv = ["blocks.0.attn.k.weight", "blocks.3.attn.v.weight"] if llama and t > KV_HEADS else []
    assert set(replicated + shared_kv) <= set(spread)
    assert all(v == 0.0 for v in spread.values()), {k: v for k, v in spread.items() if v}


def check_tp_traffic(s, world, t, d, sp, m, sharded=False, llama=False):
    comm, expected = s["comm"], s["expected_comm"]
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    for op, e in expected["by_op"].items():
        assert comm["by_op"][op]["sent_bytes"] == e["sent_bytes"], op  # floats of equal exact fractions
        assert comm["by_op"][op]["payload_bytes"] == e["payload_bytes"], op
    assert set(comm["by_op"]) == set(expected["by_op"])

    # docs/theory/tensor-parallel.md written out: per layer and microbatch 8·b·s·h·(t-1)/t elements sent per rank,
    # plus the embedding's and the head's b·s·h (as one all-reduce each, or as its all-gather +
    # reduce-scatter), the loss's 3 all-reduces of b·s fp32 values, and once per step the
    # sequence-sharded gradients over tp (GPT-2: two LayerNorms and two row-parallel biases per
    # layer, the final LayerNorm, the position table; Llama: two RMSNorm weights per layer and the
    # final one), the shared K/V heads' gradients over tp (Llama at tp 4: all of K and V, 2·h·h_kv
    # per layer) and every local gradient over dp.
    b = GLOBAL_BATCH // d // m
    bsh = b * S * H
    activations = m * (L * 8 * bsh * Fraction(t - 1, t) + 2 * 2 * bsh * Fraction(t - 1, t))
    if sharded:  # each block's attention and MLP inputs and the head's, all-gathered again in backward
        activations += m * (2 * L + 1) * bsh * Fraction(t - 1, t)
    loss = m * 2 * Fraction(t - 1, t) * 3 * b * S
    sequence_sharded = L * 2 * H + H if llama else L * 6 * H + 2 * H + S * H
    sp_grads = 2 * Fraction(t - 1, t) * sequence_sharded if sp else 0
    kv_grads = 2 * Fraction(t - 1, t) * L * 2 * H * KV_HEADS * HEAD_DIM if llama and t > KV_HEADS else 0
    local = s["model"]["local_parameters"]
    assert local == s["model"]["local_params_formula"]
    assert s["model"]["parameters"] == s["model"]["params_formula"]
    dp_grads = 2 * Fraction(d - 1, d) * local
    per_rank_bytes = 4 * (activations + loss + sp_grads + kv_grads + dp_grads)
    assert Fraction(comm["sent_bytes_per_step_exact"]) == per_rank_bytes * world
    assert comm["by_rank"] == [float(per_rank_bytes)] * world
    if d > 1:
        assert comm["by_group"]["dp"]["sent_bytes"] == float(4 * dp_grads * world)
    assert not any(tag.startswith("tooling/") for tag in comm["by_tag"])
    assert "tooling/loss" in comm["tooling"]["by_tag"] or d == 1  # the log's loss: over dp only


def check_megatron_counts(run, world, sp, m, sharded=False, kv_shared=False):
    """Per block, per microbatch and rank: 2 forward and 2 backward all-reduces (tp), or 2
    all-gathers + 2 reduce-scatters forward and the same backward (tp_sp), and with sharded saving
    one more all-gather of each region's input in backward (`regather`, the head's too)."""
    by = run.summary["comm"]["by_tag_op"]
    region = {"all_gather": m, "reduce_scatter": m} if sp else {"all_reduce": m}
    for i in range(L):
        for part in ("attn", "mlp"):
            for direction in ("fwd", "bwd"):
                calls = {op: t["calls"] // world for op, t in by[f"tp/blocks.{i}.{part}/{direction}"].items()}
                assert calls == region, (i, part, direction, calls)
            regather = by.get(f"tp/blocks.{i}.{part}/regather")
            assert ({op: t["calls"] // world for op, t in regather.items()} if regather else None) == (
                {"all_gather": m} if sharded else None), (i, part, regather)
    assert ("tp/head/regather" in by) is sharded
    if sp:
        assert {op: t["calls"] // world for op, t in by["tp/embed/fwd"].items()} == {"reduce_scatter": m}
        assert {op: t["calls"] // world for op, t in by["tp/embed/bwd"].items()} == {"all_gather": m}
        assert {op: t["calls"] // world for op, t in by["tp/head/fwd"].items()} == {"all_gather": m}
        assert {op: t["calls"] // world for op, t in by["tp/head/bwd"].items()} == {"reduce_scatter": m}
        assert by["tp/sp_grads"]["all_reduce"]["calls"] == world  # once per step, not per microbatch
    else:
        assert by["tp/embed/fwd"]["all_reduce"]["calls"] == m * world and "tp/embed/bwd" not in by
        assert by["tp/head/bwd"]["all_reduce"]["calls"] == m * world and "tp/head/fwd" not in by
        assert "tp/sp_grads" not in by
    assert by["tp/loss/fwd"]["all_reduce"]["calls"] == 3 * m * world
    assert ("tp/kv_grads" in by) is kv_shared
    if kv_shared:
        assert by["tp/kv_grads"]["all_reduce"]["calls"] == world  # once per step, not per microbatch
    # The same count, step by step, in rank 0's metrics.jsonl.
    for record in run.metrics():
        assert record["rank0_calls"]["tp/blocks.2.mlp/bwd"] == region


def check_saved_bytes(s, world, t, d, sp, m, sharded, model):
    """Every rank's bytes saved for backward at the step's peak, measured by the saved-tensor meter,
    equal the formula to the byte; sharded saving keeps, of each of the 2L + 1 column-parallel
    inputs (attention's, the MLP's in every block, the head's), b·(s/t)·h of b·s·h elements."""
    memory = s["memory"]
    assert memory["activations_match_theory"] is True
    assert memory["activations_bytes_measured"] == memory["theory"]["activation_bytes"]
    if sharded:
        b = GLOBAL_BATCH // d // m
        gathered = registry_activations(model, layout_of(ParallelDims.resolve(world, tp=t), microbatches=m,
                                                  microbatch_size=b, sequence_parallel=sp))
        saved = (2 * L + 1) * b * (S - S // t) * H * 4
        assert memory["activations_bytes_measured"] == [g - saved for g in gathered]


@pytest.mark.parametrize("case_id,world,overrides,t,d,sp,m", CASES, ids=[c[0] for c in CASES])
def test_tp_matches_single_and_theory(case_id, world, overrides, t, d, sp, m, request, pools, tmp_path):
    llama = LLAMA in overrides
    settings, single_fixture, model = MODELS["tiny_llama" if llama else "tiny"]
    single_run = request.getfixturevalue(single_fixture)
    overrides = [o for o in overrides if o != LLAMA]
    run = pools.run(world, [*settings, *overrides, "train.save_final=true", "train.save_grads=true"], tmp_path / "run")
    s = assert_ok(run)
    p = s["parallel"]
    sharded = SHARDED in overrides
    assert (s["strategy"], p["tp"], p["dp"], p["sequence_parallel"], p["microbatches"]) == ("tp", t, d, sp, m)
    assert p["tp_saves"] == ("sharded" if sharded else "gathered" if sp else None)
    check_matches_single(run, single_run)
    check_grads_match_single(run, single_run, llama, t)
    check_tp_traffic(s, world, t, d, sp, m, sharded, llama)
    check_megatron_counts(run, world, sp, m, sharded, kv_shared=llama and t > KV_HEADS)
    check_saved_bytes(s, world, t, d, sp, m, sharded, model)
    # The Megatron all-reduces block forward and backward: exposed communication over tp.
    assert check_time_breakdown(s)["compute"] > 0
    assert s["time_breakdown"]["exposed_comm_s"].get("all_reduce tp", 0) > 0
    check_trace(run.run_dir, s)
