"""The GPU's posting of the pipeline's sends and receives, run on the CPU: parallel.pp_posting=nccl on gloo.

Under NCCL the executor posts every send and receive alone on its link, a 2-rank group of one
direction of one neighbour pair (parallel/pp/posting.py, the groups by parallel/dist/groups.py
`link_groups`). Gloo runs the same calls, so the three schedules that hung on the GPU's first
posting (interleaved 1F1B, ZB-V, DualPipeV) are trained here under torchrun with exactly the
posting a GPU run uses, and checked in one run each:
  * per-step losses within 1e-5 relative of the single-process run, the same final parameters and
    data, and step 0's gradients;
  * the pipeline block says the nccl posting ran, and each rank executed exactly its list;
  * the bytes per step equal the closed forms exactly (every link logs under the "pp" group), with
    2·m sends per crossing;
  * dp 2 x pp 2 (two pipelines: every rank makes every pipeline's link groups) the same way, and its
    time breakdown and trace.json add up.
What NCCL itself does with these calls (its own queues and streams) can only be seen on GPUs; its
rules are played for every schedule and size in tests/unit/test_pp_posting.py.
"""

from fractions import Fraction

import pytest
from launcher import TINY, assert_ok, check_matches_single, check_step0_grads_match
from observability import check_time_breakdown, check_trace

from parallel.pp.schedules import build_schedule, schedule_placement

S, H = 32, 64  # the tiny model's sequence length and width
CASES = [
    # id, world, preset, dp, microbatches
    ("interleaved-p2-v2-m4", 2, "pp_interleaved", 1, 4),
    ("zbv-p2-m4", 2, "pp_zbv", 1, 4),
    ("dualpipev-p2-m4", 2, "pp_dualpipev", 1, 4),
    ("dp2xpp2-dualpipev-m4", 4, "pp_dualpipev", 2, 4),
]
SCHEDULE = {"pp_interleaved": "interleaved_1f1b", "pp_zbv": "zbv", "pp_dualpipev": "dualpipev"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_gpu_posting_on_gloo_matches_single(pools, case, single_run, tmp_path):
    _, world, preset, dp, m = case
    pp, v, schedule = world // dp, 2, SCHEDULE[preset]
    run = pools.run(world, [*TINY, f"parallel={preset}", f"parallel.dp={dp}", f"parallel.microbatches={m}",
                            "parallel.pp_posting=nccl", "train.save_final=true", "train.save_grads=true"],
                    tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "pp" and s["parallel"]["backend"] == "gloo" and s["pipeline"]["posting"] == "nccl"
    check_matches_single(run, single_run)
    check_step0_grads_match(run, single_run)

    plans = build_schedule(schedule, pp, m, v)
    for rank, executed in enumerate(s["pipeline"]["executed_by_rank"]):
        assert executed == [str(a) for a in plans[rank // dp]], f"rank {rank}"  # rank = pp_rank·dp + dp_rank

    crossings = schedule_placement(schedule, pp, v).crossings()
    b = 16 // (dp * m)
    p2p = 2 * m * crossings * b * S * H * 4 * dp
    grad_sync = Fraction(2 * (dp - 1), dp) * s["model"]["parameters"] * 4 * dp
    comm = s["comm"]
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    assert Fraction(comm["sent_bytes_per_step_exact"]) == p2p + grad_sync
    assert comm["by_op"]["send"]["sent_bytes"] == p2p and comm["by_op"]["send"]["calls"] == 2 * m * crossings * dp
    if dp > 1:
        parts = check_time_breakdown(s)
        assert parts["bubble"] > 0 and parts["compute"] > 0
        check_trace(run.run_dir, s)
