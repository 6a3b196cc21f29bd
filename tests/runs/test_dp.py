"""Data parallelism (naive, bucketed, and PyTorch DDP as a baseline) against the single run.

Each case trains the tiny model for 6 steps under torchrun on gloo and checks:
  * per-step losses within 1e-5 relative of the single-process run, and the same final parameters;
  * the bytes the communication log recorded per step equal parallel/dp/theory.py exactly, and the
    closed form 2(N-1)/N * Ψ * 4 bytes per rank written out here from docs/theory/data-parallel.md;
  * how the traffic was sent (one call per gradient for naive, one per bucket for bucketed);
  * that every rank saw the same data as the single run.
"""

from fractions import Fraction

import pytest
from launcher import TINY, TINY_LLAMA, assert_ok, check_matches_single
from observability import check_time_breakdown, check_trace

# 0.1 MiB buckets cut the tiny model (0.94 MB of gradients) into several buckets, so the
# bucket hooks, their ordering and the overlap are really exercised.
SMALL_BUCKETS = "parallel.bucket_mb=0.1"


def check_dp_traffic(s, world):
    comm, expected = s["comm"], s["expected_comm"]
    # Closed form, written out independently of parallel/dp/theory.py: 2(N-1)/N * Ψ * 4 bytes per rank.
    psi = s["model"]["parameters"]
    assert psi == s["model"]["params_formula"]
    per_rank = Fraction(2 * (world - 1), world) * psi * 4
    assert Fraction(expected["sent_bytes_per_step_exact"]) == per_rank * world
    assert Fraction(comm["sent_bytes_per_step_exact"]) == per_rank * world
    assert s["comm_matches_theory"] is True
    assert comm["steady"] is True, comm["sent_bytes_by_step"]
    assert list(comm["by_op"]) == ["all_reduce"] and list(comm["by_group"]) == ["dp"]
    assert comm["payload_bytes_per_step"] == psi * 4 * world
    assert comm["by_rank"] == [float(per_rank)] * world
    # Whole-run sums: every step moved the same bytes.
    assert comm["run"]["steps"] == 6 and comm["run"]["sent_bytes"] == float(per_rank * world * 6)
    if s["strategy"] == "dp":
        # (Not for torch_ddp: DDP rebuilds its buckets after the first iteration, in the order
        # gradients actually arrived, so its first step sends the same bytes in other calls.)
        assert comm["run"]["by_group"]["dp"]["calls"] == comm["calls_per_step"] * 6
    # The loss reduction for the log is the tools' traffic, counted apart.
    assert "tooling/loss" in comm["tooling"]["by_tag"]
    assert not any(tag.startswith("tooling/") for tag in comm["by_tag"])


N_PARAM_TENSORS_TINY = 2 + 4 * 16 + 3  # embed (tok, pos), 16 per block, head (ln_f w, b, out)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("preset", ["dp", "dp_naive"])
def test_dp_matches_single_and_theory(pools, preset, world, microbatches, single_run, tmp_path):
    run = pools.run(world, [*TINY, f"parallel={preset}", f"parallel.microbatches={microbatches}", SMALL_BUCKETS,
                            "train.save_final=true"], tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "dp" and s["world_size"] == world and s["parallel"]["dp"] == world
    assert s["parallel"]["grad_sync"] == ("naive" if preset == "dp_naive" else "bucketed")
    check_matches_single(run, single_run)
    check_dp_traffic(s, world)
    # Where the time went: the gradient all-reduces over dp are exposed communication (waited for
    # after backward: naive, or the buckets backward did not hide), no bubble; the trace has every call.
    parts = check_time_breakdown(s)
    assert parts["compute"] > 0 and parts["optimizer"] > 0 and parts["bubble"] == 0
    assert "all_reduce dp" in s["time_breakdown"]["exposed_comm_s"]
    check_trace(run.run_dir, s)
    calls = s["comm"]["calls_per_step"]
    if preset == "dp_naive":
        assert calls == N_PARAM_TENSORS_TINY * world  # one all-reduce per gradient, per rank
        assert "grads/blocks.0" in s["comm"]["by_tag"]
    else:
        buckets = calls // world
        assert buckets > 3, "0.1 MiB buckets should cut the tiny model into several buckets"
        assert set(s["comm"]["by_tag"]) == {f"grads/bucket{i}" for i in range(buckets)}
        # Gradient accumulation must not add syncs: one all-reduce per bucket per step.
        assert all(t["calls"] == world for t in s["comm"]["by_tag"].values())


def test_torch_ddp_baseline_matches_single_and_theory(pools, single_run, tmp_path):
    run = pools.run(2, [*TINY, "parallel=torch_ddp", "parallel.microbatches=2", SMALL_BUCKETS, "train.save_final=true"],
                    tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "torch_ddp"
    check_matches_single(run, single_run)
    check_dp_traffic(s, 2)
    # DDP waits for its all-reduces inside backward: the breakdown still adds up, says why its dp
    # wait is compute, and the trace still holds every bucket's bytes (on the hook's posts).
    parts = check_time_breakdown(s)
    assert parts["compute"] > 0 and "all_reduce dp" not in s["time_breakdown"]["exposed_comm_s"]
    assert any("DDP waits" in note for note in s["time_breakdown"]["notes"])
    check_trace(run.run_dir, s)


def test_a_head_tied_to_the_token_table_trains_as_single(pools, tmp_path):
    """model.tied_head=true on Llama's block: one Parameter in embed.tok and head.out, whose gradient
    sums both uses before dp all-reduces it once. dp 2 with 2 microbatches trains the single run's
    model, its Ψ counts the table once, and the two names stay one tensor. So do tp_sp at tp 4 (the
    vocab-parallel table and head hold the same rows of the one shard; kv heads replicated) and the
    cp ring at cp 2, each with its bytes and saved activations equal to theory."""
    tied = [*TINY_LLAMA, "model.tied_head=true", "train.save_final=true"]
    single = pools.run(1, [*tied, "parallel=single"], tmp_path / "single")
    assert_ok(single)
    run = pools.run(2, [*tied, "parallel=dp", "parallel.microbatches=2", SMALL_BUCKETS], tmp_path / "dp")
    s = assert_ok(run)
    check_matches_single(run, single)
    check_dp_traffic(s, 2)
    untied = 2 * 256 * 64 + 4 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192) + 64  # tiny_llama's Ψ
    assert s["model"]["parameters"] == untied - 256 * 64
    params = run.final_params
    assert params["head.out.weight"].equal(params["embed.tok.weight"])
    for name, world, overrides in (("tp_sp4", 4, ["parallel=tp_sp", "parallel.tp=4"]), ("cp2", 2, ["parallel=cp"])):
        run = pools.run(world, [*tied, *overrides], tmp_path / name)
        s = assert_ok(run)
        check_matches_single(run, single)
        assert s["comm_matches_theory"] is True and s["memory"]["activations_match_theory"] is True, name


def test_same_config_twice_gives_identical_numbers(pools, tmp_path):
    args = [*TINY, "parallel=dp", "parallel.microbatches=2", SMALL_BUCKETS]
    first = assert_ok(pools.run(2, args, tmp_path / "a"))
    second = assert_ok(pools.run(2, args, tmp_path / "b"))
    assert first["losses"] == second["losses"]


def test_single_run_is_deterministic(pools, single_run, single_run_llama, tmp_path):
    for settings, reference in ((TINY, single_run), (TINY_LLAMA, single_run_llama)):
        again = pools.run(1, [*settings, "parallel=single"], tmp_path / settings[0].split("=")[1])
        assert assert_ok(again)["losses"] == reference.summary["losses"], settings[0]


def test_single_summary_schema(single_run):
    s = single_run.summary
    for key in ("config", "world_size", "parallel", "losses", "step_time_s", "tokens_per_s", "peak_memory_bytes",
                "comm", "expected_comm"):
        assert key in s, key
    for key in ("by_op", "by_group", "by_tag", "sent_bytes_per_step"):
        assert key in s["comm"], key
    assert "by_op" in s["expected_comm"] and "sent_bytes_per_step" in s["expected_comm"]
    assert s["strategy"] == "single" and s["world_size"] == 1
    assert s["comm"]["sent_bytes_per_step"] == 0 == s["expected_comm"]["sent_bytes_per_step"]
    assert s["tokens_per_s"] > 0 and s["peak_memory_bytes"] > 0
    assert s["peak_memory_scope"].startswith("the whole process")  # the CPU's peak RSS cannot be reset
    assert s["config"]["model"]["d_model"] == 64  # the resolved config, not the preset name
    # Losses go down on real text (a smoke check that training trains).
    assert s["losses"][-1] < s["losses"][0]
    # One process: no communication to wait for, and a trace of one rank.
    parts = check_time_breakdown(s)
    assert parts["exposed_comm"] == parts["bubble"] == 0 and parts["compute"] > 0
    check_trace(single_run.run_dir, s)
