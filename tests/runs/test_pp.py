"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B; and dp x pp) against the single run.

Each case trains the tiny model (4 layers; one case its Llama-shaped twin, model=tiny_llama) for 6
steps under torchrun on gloo and checks:
  * per-step losses within 1e-5 relative of the single-process run, the same final parameters
    (gathered from the stages) and the same data;
  * step 0's full-model gradients equal the single run's (the microbatch losses are scaled by the
    global token count, not the microbatch's: otherwise they would be m times too large);
  * the bytes per step equal parallel/pp/theory.py exactly and 2·m·(v·p-1)·b·s·h·4 written out here;
  * the order each rank executed is exactly its schedule's list;
  * the run reported the bubble beside the simulator's and the closed form, and its time breakdown
    (waiting for the neighbour stage is the bubble) and trace.json of every rank add up.
"""

from fractions import Fraction

import pytest
from launcher import TINY, TINY_LLAMA, assert_ok, check_matches_single, check_step0_grads_match
from observability import check_time_breakdown, check_trace

from parallel.pp.schedules import build_schedule

S, H = 32, 64  # the tiny model's sequence length and width

# GPipe and 1F1B at pp 2 and 4, between them m = p, 2p, and an odd m (above p at pp 2, below p at
# pp 4, where 1F1B's warm-up is capped at m); interleaved at pp 2 with v 2; dp x pp. Every
# schedule shape for p <= 8, m <= 16 is checked without processes in test_pp_schedules.py: these
# runs prove the executor runs the lists with the right numbers.
CASES = [
    # id, world, preset, dp, pp, microbatches, virtual, global batch
    *[(f"{name}-p{p}-m{m}", p, preset, 1, p, m, 1, 12 if m == 3 else 16)
      for name, preset, p, m in (("gpipe", "pp_gpipe", 2, 3), ("gpipe", "pp_gpipe", 4, 4), ("1f1b", "pp_1f1b", 2, 4),
                                 ("1f1b", "pp_1f1b", 4, 3), ("1f1b", "pp_1f1b", 4, 8))],
    ("interleaved-p2-v2-m2", 2, "pp_interleaved", 1, 2, 2, 2, 16),
    ("interleaved-p2-v2-m4", 2, "pp_interleaved", 1, 2, 4, 2, 16),
    ("dp2xpp2-1f1b-m2", 4, "pp_1f1b", 2, 2, 2, 1, 16),
    # The bucketed dp sync on two chunks a rank: each chunk's last backward counts its parameters down.
    ("dp2xpp2-interleaved-v2-m2-bucketed", 4, "pp_interleaved", 2, 2, 2, 2, 16),
    # Llama's block (GQA, SwiGLU, RMSNorm, RoPE, no biases): the same boundary activations, other stages.
    ("llama-interleaved-p2-v2-m4", 2, "pp_interleaved", 1, 2, 4, 2, 16),
]
SCHEDULE = {"pp_gpipe": "gpipe", "pp_1f1b": "1f1b", "pp_interleaved": "interleaved_1f1b"}
RUN_ONLY = {"dp2xpp2-interleaved-v2-m2-bucketed": ["parallel.grad_sync=bucketed"]}  # the run's, not the reference's


@pytest.fixture(scope="module")
def single_run_gb12(pools, tmp_path_factory):
    """The reference for odd microbatch counts: a global batch of 12 sequences divides by 3."""
    run = pools.run(1, [*TINY, "train.global_batch=12", "parallel=single", "train.save_final=true",
                        "train.save_grads=true"],
                    tmp_path_factory.mktemp("single12") / "run")
    assert_ok(run)
    return run


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pipeline_matches_single_and_theory(case, request, pools, tmp_path):
    name, world, preset, dp, pp, m, v, gb = case
    llama = name.startswith("llama-")
    ref = request.getfixturevalue("single_run_llama" if llama else "single_run" if gb == 16 else "single_run_gb12")
    base = TINY_LLAMA if llama else TINY
    run = pools.run(world, [*base, f"train.global_batch={gb}", f"parallel={preset}", f"parallel.dp={dp}",
                            f"parallel.microbatches={m}", f"parallel.virtual_stages={v}", *RUN_ONLY.get(name, []),
                            "train.save_final=true", "train.save_grads=true"], tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "pp" and (s["parallel"]["dp"], s["parallel"]["pp"]) == (dp, pp)
    assert any(tag.startswith("grads/bucket") for tag in s["comm"]["by_tag"]) is (name in RUN_ONLY)
    check_matches_single(run, ref)

    check_step0_grads_match(run, ref)

    # Bytes: 2·m·(v·p-1)·b·s·h·4 per pipeline (docs/theory/combined.md), dp pipelines, plus the dp
    # all-reduce of all gradients when dp > 1: 2(dp-1)/dp·Ψ·4 on each of the world's ranks... summed
    # over the stages of a pipeline that is 2(dp-1)/dp·Ψ·4 per pipeline position, dp of them.
    b = gb // (dp * m)
    p2p = 2 * m * (v * pp - 1) * b * S * H * 4 * dp
    psi = s["model"]["parameters"]
    grad_sync = Fraction(2 * (dp - 1), dp) * psi * 4 * dp
    comm = s["comm"]
    assert Fraction(comm["sent_bytes_per_step_exact"]) == p2p + grad_sync
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    assert comm["by_op"]["send"]["sent_bytes"] == p2p and comm["by_op"]["recv"]["sent_bytes"] == 0
    assert comm["by_op"]["send"]["payload_bytes"] == comm["by_op"]["recv"]["payload_bytes"] == p2p
    # Every boundary sees each microbatch once per direction: 2·m calls per boundary per pipeline.
    boundaries = v * pp - 1
    assert comm["by_op"]["send"]["calls"] == 2 * m * boundaries * dp
    assert len([t for t in comm["by_tag"] if t.startswith("pp/fwd/")]) == boundaries

    # The order each rank ran is exactly its schedule's list.
    plans = build_schedule(SCHEDULE[preset], pp, m, v)
    executed = s["pipeline"]["executed_by_rank"]
    for rank in range(world):
        pp_rank = rank // dp  # rank = pp_rank·dp + dp_rank (tp = 1)
        assert executed[rank] == [str(a) for a in plans[pp_rank]], f"rank {rank}"

    pipe = s["pipeline"]
    assert pipe["bubble_closed_form"] == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert 0.0 <= pipe["bubble_simulated"] < 1.0 and 0.0 <= pipe["bubble_measured"] < 1.0
    # A later stage waits for the first microbatch's activations: pipeline p2p waits are the bubble.
    parts = check_time_breakdown(s)
    assert parts["bubble"] > 0 and parts["compute"] > 0
    assert not any(k.startswith(("send pp", "recv pp")) for k in s["time_breakdown"]["exposed_comm_s"])
    check_trace(run.run_dir, s)


def test_a_registered_schedule_trains_as_the_single_run(single_run, tmp_path):
    """tests/helpers/custom_schedule.py registers gpipe_lifo in every worker and calls launch.train: the run
    equals the single-process run (losses within 1e-5, final parameters, step-0 gradients), each rank
    ran exactly its list, and summary.json says "no closed form" for its bubble."""
    import os
    import subprocess
    import sys

    from launcher import CPU_ONLY, PROJECT_ROOT, TINY, Run, assert_ok, check_matches_single, check_step0_grads_match

    run_dir = tmp_path / "lifo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(PROJECT_ROOT / "tests" / "helpers" / "custom_schedule.py"), *TINY, "parallel=pp_gpipe",
           "parallel.schedule=gpipe_lifo", "parallel.microbatches=4", "train.save_final=true",
           "train.save_grads=true", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CPU_ONLY})
    run = Run(proc.returncode, proc.stdout, proc.stderr, run_dir)
    s = assert_ok(run)
    check_matches_single(run, single_run)
    check_step0_grads_match(run, single_run)
    pipe = s["pipeline"]
    assert pipe["schedule"] == "gpipe_lifo" and pipe["bubble_closed_form"] is None
    assert pipe["bubble_closed_form_note"].startswith("no closed form")
    assert 0.0 <= pipe["bubble_simulated"] < 1.0
    # The custom list is what ran (not GPipe's): rank 0 ends with B0, the last backward of the stack.
    from custom_schedule import gpipe_lifo

    plans = gpipe_lifo(2, 4)
    assert pipe["executed_by_rank"] == [[str(a) for a in plans[r]] for r in range(2)]
    assert pipe["executed_by_rank"][0][-1] == "B0"
