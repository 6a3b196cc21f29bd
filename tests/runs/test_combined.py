"""dp x tp x pp on one mesh (parallel=3d) against the single run, and its checkpoint interface.

Each multi-process case trains the tiny model for 6 steps under torchrun on gloo and checks:
  * per-step losses within 1e-5 relative of the single-process run, the same final parameters
    (gathered over tp, then over the stages) and the same data;
  * step 0's full-model gradients equal the single run's, and every replicated gradient is the
    same on all tp ranks;
  * the bytes per step equal parallel/compose/theory.py exactly, op by op, group by group and rank by
    rank (ranks of different stages send different amounts);
  * each block's tp collectives ran only on the d·t ranks of the stage that holds the block (and with
    parallel.tp_saves=sharded its inputs' regathers, the saved bytes equal to the formula);
  * each rank ran exactly its schedule's list.
"""

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from launcher import TINY, TINY_LLAMA, assert_ok, check_matches_single, check_step0_grads_match, max_rel_diff
from observability import check_time_breakdown, check_trace
from test_tp import HEAD_DIM, KV_HEADS, check_grads_match_single

from parallel.compose.combined import build_combined
from parallel.core.model import GPT, GPTConfig
from parallel.dist.dims import ParallelDims
from parallel.pp.schedules import build_schedule, schedule_placement
from parallel.registry import layout_of
from parallel.tp.layers import parallelize_tp

L = 4  # the tiny model's layers

CASES = [
    # id, world, overrides, (dp, tp, pp), sequence parallel, microbatches, virtual, schedule
    ("dp2xtp2xpp2-1f1b-sp", 8, ["parallel=3d", "parallel.microbatches=2", "parallel.sequence_parallel=true",
                                "parallel.bucket_mb=0.1"], (2, 2, 2), True, 2, 1, "1f1b"),
    ("dp1xtp2xpp2-interleaved", 4, ["parallel=pp_interleaved", "parallel.tp=2", "parallel.microbatches=2"],
     (1, 2, 2), False, 2, 2, "interleaved_1f1b"),
    ("dp2xtp2xpp1-gpipe", 4, ["parallel=3d", "parallel.pp=1", "parallel.schedule=gpipe", "parallel.microbatches=2"],
     (2, 2, 1), False, 2, 1, "gpipe"),
    # The column-parallel linears keep their input's sequence piece and gather it again in backward.
    ("dp1xtp2xpp2-1f1b-sp-sharded", 4, ["parallel=3d", "parallel.microbatches=2", "parallel.sequence_parallel=true",
                                        "parallel.tp_saves=sharded"], (1, 2, 2), True, 2, 1, "1f1b"),
    # Under a split backward the piece is gathered in W, where the weight gradients are formed: B
    # forms the input's gradient alone, so still one regather per region and microbatch.
    ("dp1xtp2xpp2-zbh1-sp-sharded", 4, ["parallel=3d", "parallel.schedule=zbh1", "parallel.microbatches=4",
                                        "parallel.sequence_parallel=true", "parallel.tp_saves=sharded"],
     (1, 2, 2), True, 4, 1, "zbh1"),
    ("llama-dp1xtp2xpp2-zbv-sp-sharded", 4, ["model=tiny_llama", "parallel=3d", "parallel.schedule=zbv",
                                             "parallel.virtual_stages=2", "parallel.microbatches=4",
                                             "parallel.sequence_parallel=true", "parallel.tp_saves=sharded"],
     (1, 2, 2), True, 4, 2, "zbv"),
]
V_SHAPED = ("zbv", "dualpipev")  # the V's crossings: 2(p-1), its turn inside rank p-1 sending nothing


@pytest.mark.parametrize("case_id,world,overrides,layout,sp,m,v,schedule", CASES, ids=[c[0] for c in CASES])
def test_3d_matches_single_and_theory(case_id, world, overrides, layout, sp, m, v, schedule, request, pools,
                                      tmp_path):
    llama = LLAMA in overrides
    single_run = request.getfixturevalue("single_run_llama" if llama else "single_run")
    timeline = ["run.timeline=true"] if layout == (2, 2, 2) else []  # one picture of all 8 ranks
    run = pools.run(world, [*(TINY_LLAMA if llama else TINY), *[o for o in overrides if o != LLAMA],
                            *timeline, "train.save_final=true", "train.save_grads=true"], tmp_path / "run", timeout=400)
    s = assert_ok(run)
    d, t, p = layout
    par = s["parallel"]
    assert s["strategy"] == "3d" and (par["dp"], par["tp"], par["pp"]) == layout
    assert (par["sequence_parallel"], par["microbatches"], par["virtual_stages"], par["schedule"]) \
        == (sp, m, v, schedule)
    check_matches_single(run, single_run)
    check_grads_match_single(run, single_run, llama, t)
    dims = check_bytes_equal_theory(s, world, layout)
    assert s["model"]["local_parameters"] == s["model"]["local_params_formula"]
    # One stage: every rank holds its tp shard's parameters, gradients and Adam state, 16·Ψ_t bytes.
    assert s["memory"]["matches_formula"] is (True if p == 1 else None)
    check_tp_and_pp_calls(s, layout, sp, m, v, sharded="parallel.tp_saves=sharded" in overrides,
                          crossings=2 * (p - 1) if schedule in V_SHAPED else v * p - 1)

    plans = build_schedule(schedule, p, m, v)
    executed = s["pipeline"]["executed_by_rank"]
    for rank in range(world):
        assert executed[rank] == [str(a) for a in plans[dims.coordinates(rank)["pp"]]], f"rank {rank}"

    # Every rank's time, and every rank in the trace under its global rank and (pp, dp, tp), with its
    # tp and dp collectives and pp sends; the picture of all of them where asked for.
    parts = check_time_breakdown(s)
    exposed = s["time_breakdown"]["exposed_comm_s"]
    assert exposed.get("all_reduce tp", 0) > 0 and (d == 1 or "all_reduce dp" in exposed)
    assert (parts["bubble"] > 0) is (p > 1)
    trace = check_trace(run.run_dir, s)
    groups = {e["args"]["group"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] in (1, 2)}
    assert {"tp", *(["dp"] if d > 1 else []), *(["pp"] if p > 1 else [])} <= groups
    assert (run.run_dir / "timeline.png").exists() is bool(timeline)


def check_bytes_equal_theory(s: dict, world: int, layout: tuple) -> ParallelDims:
    """The bytes per step equal parallel/compose/theory.py's op by op, group by group and rank by
    rank; returns the run's dimensions."""
    comm, expected = s["comm"], s["expected_comm"]
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    assert set(comm["by_op"]) == set(expected["by_op"])
    for op, e in expected["by_op"].items():
        assert comm["by_op"][op]["sent_bytes"] == e["sent_bytes"], op
        assert comm["by_op"][op]["payload_bytes"] == e["payload_bytes"], op
    assert set(comm["by_group"]) == set(expected["by_group"])
    for group, e in expected["by_group"].items():
        assert comm["by_group"][group]["sent_bytes"] == e["sent_bytes"], group
    d, t, p = layout
    dims = ParallelDims.resolve(world, dp=d, tp=t, pp=p)
    by_stage = expected["sent_bytes_per_rank_by_stage"]
    assert comm["by_rank"] == [by_stage[dims.coordinates(r)["pp"]] for r in range(world)]
    return dims


def check_tp_and_pp_calls(s: dict, layout: tuple, sp: bool, m: int, v: int, sharded: bool, crossings: int) -> None:
    """A block's tp collectives run on the d·t ranks of its stage only, m times per direction; with
    sharded saving each region's input is gathered again in backward; the boundary sends' bytes, over
    `crossings` stage boundaries a microbatch crosses each way."""
    d, t, p = layout
    comm = s["comm"]
    by = comm["by_tag_op"]
    for i in range(L):
        calls = sum(c["calls"] for c in by[f"tp/blocks.{i}.mlp/fwd"].values())
        assert calls == (2 if sp else 1) * m * d * t, (i, calls)
    assert by["tp/loss/fwd"]["all_reduce"]["calls"] == 3 * m * d * t  # the last stage only
    b = 16 // (d * m)
    # Sharded saving: each region's input (attention, MLP, the head) all-gathered once more in backward, b·s·h.
    regathers = [f"tp/blocks.{i}.{part}/regather" for i in range(L) for part in ("attn", "mlp")] + ["tp/head/regather"]
    for tag in regathers:
        if sharded:
            gathers = by[tag]["all_gather"]
            assert (gathers["calls"], gathers["payload_bytes"]) == (m * d * t, m * d * t * b * 32 * 64 * 4), tag
        else:
            assert tag not in by, tag
    if sharded:  # and what each rank saves for backward is the formula's, to the byte (per stage: they differ)
        assert s["memory"]["activations_match_theory"] is True
    if p > 1:
        # Boundary activations: b·s·h, or each tp rank's b·(s/t)·h piece under sequence parallelism.
        sends = comm["by_op"]["send"]
        assert sends["payload_bytes"] == sends["calls"] * b * (32 // t if sp else 32) * 64 * 4
        assert sends["calls"] == 2 * m * crossings * d * t


# -- ZeRO-1/2 as the dp dimension (parallel.zero) ------------------------------------------------------
V, H, S, F = 256, 64, 32, 256  # the tiny model
F_LLAMA = 192  # tiny_llama's gated MLP width
LLAMA = "model=tiny_llama"


def stage_holds(schedule: str, p: int, v: int) -> list[tuple[list[int], bool, bool]]:
    """Per pipeline rank, the blocks it holds and whether it holds the embedding and the head, by the
    schedule's placement: the loop's (virtual stage j on rank j mod p) or the V's (r and 2p-1-r)."""
    placement = schedule_placement(schedule, p, v)
    per = L // placement.vstages  # blocks per virtual stage
    return [([i for i in range(L) if placement.rank_of(i // per) == r], placement.rank_of(0) == r,
             placement.rank_of(placement.vstages - 1) == r) for r in range(p)]


def stage_parts(t: int, blocks: int, first: bool, last: bool, llama: bool = False) -> list[int]:
    """The parts one rank holds (the embedding where `first`, its `blocks`, the head where `last`),
    cut over t tp ranks, written out. GPT's: token rows V·h/t + positions s·h; per block two norms
    4h, Q/K/V 3(h² + h)/t, output projection h²/t + h, fc (f·h + f)/t, proj f·h/t + h; final norm
    2h + head rows V·h/t.
    Llama's: token rows V·h/t; per block two norms 2h, Q and the output projection h²/t each, K and
    V h·(kv heads x head size)/t each (one head's h·head size where t exceeds the kv heads), gate,
    up and down f·h/t each; final norm h + head rows V·h/t."""
    if llama:
        kv = KV_HEADS * HEAD_DIM // t if t <= KV_HEADS else HEAD_DIM
        block = 2 * H + 2 * H * H // t + 2 * H * kv + 3 * F_LLAMA * H // t
        embedding, head = V * H // t, H + V * H // t
    else:
        block = 4 * H + 3 * (H * H + H) // t + H * H // t + H + (F * H + F) // t + F * H // t + H
        embedding, head = V * H // t + S * H, 2 * H + V * H // t
    return [*([embedding] if first else []), *[block] * blocks, *([head] if last else [])]


ZERO_CASES = [
    # id, world, overrides, (dp, tp, pp), zero, sequence parallel, microbatches
    ("dp2xtp2xpp1-sp-zero1", 4,
     ["parallel=tp_sp", "parallel.zero=1", "parallel.microbatches=2", "train.checkpoint_every=3"],
     (2, 2, 1), 1, True, 2),
    ("dp2xtp1xpp2-1f1b-zero2", 4, ["parallel=pp_1f1b", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"],
     (2, 1, 2), 2, False, 2),
    # ZeRO-2 completes each part's partial gradients over tp (the norms' under sequence parallelism;
    # Llama's K and V where tp 4 exceeds its 2 kv heads) just before it reduce-scatters the part.
    ("dp2xtp2xpp1-sp-zero2", 4, ["parallel=tp_sp", "parallel.zero=2", "parallel.microbatches=2"],
     (2, 2, 1), 2, True, 2),
    ("llama-dp2xtp4xpp1-sp-zero2", 8,
     [LLAMA, "parallel=tp_sp", "parallel.tp=4", "parallel.zero=2", "parallel.microbatches=2"], (2, 4, 1), 2, True, 2),
    # A rank's two chunks run each microbatch's backward at different moments: each reduces its own parts.
    ("dp2xtp1xpp2-interleaved-zero2", 4,
     ["parallel=pp_interleaved", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"],
     (2, 1, 2), 2, False, 2),
    ("dp2xtp1xpp2-zbv-zero2", 4, ["parallel=pp_zbv", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=4"],
     (2, 1, 2), 2, False, 4),
    ("llama-dp2xtp1xpp2-zbv-zero2", 4,
     [LLAMA, "parallel=pp_zbv", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=4"], (2, 1, 2), 2, False, 4),
    ("dp2xtp1xpp2-dualpipev-zero2", 4,
     ["parallel=pp_dualpipev", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=4"], (2, 1, 2), 2, False, 4),
    ("llama-dp2xtp1xpp2-interleaved-zero2", 4,
     [LLAMA, "parallel=pp_interleaved", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"],
     (2, 1, 2), 2, False, 2),
]


@pytest.mark.parametrize("case_id,world,overrides,layout,zero,sp,m", ZERO_CASES, ids=[c[0] for c in ZERO_CASES])
def test_3d_with_zero_dp_matches_single_theory_and_memory(case_id, world, overrides, layout, zero, sp, m, request,
                                                          pools, tmp_path):
    llama = LLAMA in overrides
    settings = TINY_LLAMA if llama else TINY
    single_run = request.getfixturevalue("single_run_llama" if llama else "single_run")
    run = pools.run(world, [*settings, *[o for o in overrides if o != LLAMA], "train.save_final=true",
                            "train.save_grads=true"], tmp_path / "run", timeout=400)
    s = assert_ok(run)
    d, t, p = layout
    par = s["parallel"]
    assert s["strategy"] == "3d"
    assert (par["dp"], par["tp"], par["pp"], par["zero"], par["sequence_parallel"]) == (*layout, zero, sp)
    check_matches_single(run, single_run)
    if t > 1:
        check_grads_match_single(run, single_run, llama, t)  # the dp shards gathered, every tp replica complete
    else:
        check_step0_grads_match(run, single_run)
    dims = check_bytes_equal_theory(s, world, layout)
    padded = check_zero_dp_calls(s, layout, zero, sp, m, world, llama)

    # Every rank holds its stage's parameters and 1/d of their Adam state (ZeRO-2: 1/d of the
    # gradients too), measured from its tensors.
    memory = s["memory"]
    for row in memory["by_rank"]:
        pad = padded[dims.coordinates(row["rank"])["pp"]]
        expect = (4 * pad, 4 * pad // (d if zero == 2 else 1), 8 * pad // d)
        assert (row["param_bytes"], row["grad_bytes"], row["optimizer_bytes"]) == expect, row
        assert row["peak_model_state_bytes"] >= row["total_bytes"]
    assert memory["matches_formula"] is (True if p == 1 else None)  # one formula for all ranks only with one stage

    if "train.checkpoint_every=3" in overrides:
        # The checkpoint after step 3 holds Adam's moments gathered from the dp shards into the tp
        # pieces, then whole: one process resumed from it repeats the single run's steps 3..5.
        resumed = assert_ok(pools.run(1, [*TINY, "parallel=single",
                                          f"train.resume={run.run_dir}/checkpoints/step_000003"],
                                      tmp_path / "resumed"))
        assert resumed["first_step"] == 3
        assert max_rel_diff(resumed["losses"], single_run.summary["losses"][3:]) < 1e-5


def check_zero_dp_calls(s: dict, layout: tuple, zero: int, sp: bool, m: int, world: int,
                        llama: bool = False) -> list[int]:
    """ZeRO's traffic over dp, written out, part by part; returns each stage's padded element count."""
    d, t, p = layout
    comm, expected = s["comm"], s["expected_comm"]
    # Over dp, written out: each rank reduce-scatters its stage's padded parts once per step (ZeRO-1)
    # or per microbatch (ZeRO-2) and all-gathers them once, (d-1)/d of each, 4 bytes an element;
    # no dp all-reduce. The tiny models' parts are multiples of 2: no padding at dp 2.
    scatters = 1 if zero == 1 else m
    holds = stage_holds(s["parallel"]["schedule"], p, s["parallel"]["virtual_stages"])
    padded = [sum(-(-n // d) * d for n in stage_parts(t, len(blocks), first, last, llama))
              for blocks, first, last in holds]
    dp_bytes = sum(Fraction(d - 1, d) * (scatters + 1) * 4 * pad for pad in padded) * d * t
    assert comm["by_group"]["dp"]["sent_bytes"] == float(dp_bytes) == expected["by_group"]["dp"]["sent_bytes"]
    by_tag = comm["by_tag"]
    assert not any(tag.startswith("grads/") for tag in by_tag)
    for blocks, first, last in holds:
        for part in (["embed"] if first else []) + [f"blocks.{i}" for i in blocks] + (["head"] if last else []):
            assert by_tag[f"zero/grad_reduce_scatter/{part}"]["calls"] == scatters * d * t, part
            assert by_tag[f"zero/param_all_gather/{part}"]["calls"] == d * t, part
    # Summed over tp before the reduce-scatters: ZeRO-1 once a step; ZeRO-2 each microbatch, for
    # each part that holds such gradients (every part of GPT's; Llama has no positions in its
    # embedding, and its K and V replicas are only in the blocks).
    parts = L + (0 if llama else 1) + 1  # over a pipeline's ranks: the blocks, the embedding, the final norm
    if sp:
        assert by_tag["tp/sp_grads"]["calls"] == (world if zero == 1 else m * parts * d * t)
    if llama and t > KV_HEADS:
        assert by_tag["tp/kv_grads"]["calls"] == (world if zero == 1 else m * L * d * t)
    return padded


# -- the checkpoint interface, in one process: cutting needs no collective ---------------------------
CFG = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)


def _strategy(model, pp_rank, tp_rank, p=2, t=2, dp_comm=None, zero=0):
    # Building reads only the ranks and sizes of the groups; dp_comm None: no dp sync is made.
    layout = layout_of(ParallelDims(p * t, 1, tp=t, pp=p), microbatches=2, grad_sync="naive", zero=zero)
    plan = SimpleNamespace(layout=layout, microbatches=2, lr=1e-3, weight_decay=0.1, backend="gloo")
    comms = {"tp": SimpleNamespace(rank=tp_rank, size=t), "pp": SimpleNamespace(rank=pp_rank, size=p), "dp": dp_comm}
    return build_combined(model, plan, SimpleNamespace(comm=comms.get))


def test_load_full_state_keeps_each_ranks_own_piece():
    full = {n: q.detach().clone() for n, q in GPT(CFG, seed=7).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    optim = {"step": 5, "state": {n: {"exp_avg": torch.randn(q.shape, generator=gen),
                                      "exp_avg_sq": torch.rand(q.shape, generator=gen)} for n, q in full.items()}}
    pieces: dict[str, list] = {}
    for pp_rank in range(2):
        for tp_rank in range(2):
            loaded = _strategy(GPT(CFG, seed=0), pp_rank, tp_rank)
            loaded.load_full_state(full, optim)
            # The same piece parallelize_tp and the split cut from a model built with those weights.
            built = dict(_strategy(GPT(CFG, seed=7), pp_rank, tp_rank).named_full_parameters())
            assert loaded.optimizer.step_count == 5
            for name, q in loaded.named_full_parameters():
                assert torch.equal(q, built[name]), name
                state = loaded.optimizer.state[q]
                pieces.setdefault(name, []).append((tp_rank, q.detach(), state["exp_avg"], state["exp_avg_sq"]))
    # Put the pieces back together: split along the tp cut, replicated elsewhere; it is the whole.
    split_dim = parallelize_tp(GPT(CFG, seed=0), SimpleNamespace(rank=0, size=2)).split_dim
    assert pieces.keys() == full.keys()
    for name, parts in pieces.items():
        parts.sort(key=lambda x: x[0])
        for k, reference in ((1, full[name]), (2, optim["state"][name]["exp_avg"]),
                             (3, optim["state"][name]["exp_avg_sq"])):
            if name in split_dim:
                whole = torch.cat([x[k] for x in parts], dim=split_dim[name])
            else:
                assert all(torch.equal(x[k], parts[0][k]) for x in parts), name
                whole = parts[0][k]
            assert torch.equal(whole, reference), (name, k)


def test_full_state_and_optimizer_state_gather_and_reload(tmp_path):
    """Under torchrun at dp 1 x tp 2 x pp 2: gathered parameters and AdamW moments equal one
    process's after the same steps; loaded into a fresh strategy they gather back unchanged, and
    training goes on from them as the single process does (tests/helpers/combined_state_check.py)."""
    import subprocess
    import sys

    from launcher import PROJECT_ROOT
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(PROJECT_ROOT / "tests" / "helpers" / "combined_state_check.py")]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "combined state check: ok" in proc.stdout


def test_zero_dp_load_full_state_cuts_the_tp_piece_then_the_dp_shard():
    """With ZeRO-1 over dp 2, load_full_state keeps each rank's tp piece of the parameters and its
    dp shard of the Adam moments (no collective): the two dp ranks' shards, put together, are the
    moments the plain 3d strategy keeps for that tp piece."""
    full = {n: q.detach().clone() for n, q in GPT(CFG, seed=7).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    optim = {"step": 5, "state": {n: {"exp_avg": torch.randn(q.shape, generator=gen),
                                      "exp_avg_sq": torch.rand(q.shape, generator=gen)} for n, q in full.items()}}
    for pp_rank in range(2):
        for tp_rank in range(2):
            plain = _strategy(GPT(CFG, seed=0), pp_rank, tp_rank)
            plain.load_full_state(full, optim)
            plain_params = dict(plain.named_full_parameters())
            shards = []
            for dp_rank in range(2):
                sharded = _strategy(GPT(CFG, seed=0), pp_rank, tp_rank, dp_comm=SimpleNamespace(rank=dp_rank, size=2),
                                    zero=1)
                sharded.load_full_state(full, optim)
                assert sharded.optimizer is sharded.sync and sharded.sync.optimizer.step_count == 5
                for name, q in sharded.named_full_parameters():
                    assert torch.equal(q, plain_params[name]), name
                shards.append(sharded.sync)
            for i, part in enumerate(shards[0].parts):
                for key in ("exp_avg", "exp_avg_sq"):
                    joined = torch.cat([z.optimizer.shard_state(i, key) for z in shards])[: part.numel]
                    whole = torch.cat([plain.optimizer.state[plain_params[n]][key].reshape(-1) for n in part.names])
                    assert torch.equal(joined, whole), (part.name, key)
