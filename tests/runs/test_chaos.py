"""Chaos mode end to end: a seeded random SIGKILL under `torchrun --max-restarts`, the job finishing
with the uninterrupted run's losses, its failures where the seed puts them, and a goodput block
whose parts add up.

Seed 162 with M = 16 s draws, at world 2: attempt 0, rank 1 after 3.0 s; attempt 1, rank 0 after
42 s (parallel/reliability/chaos.py `draw`): on an idle machine the first kill lands in the steps
(the job takes about 5 s), on a loaded one in the set-up, and the second attempt ends before its
draw. Which step a kill lands in depends on the load, so the checks hold whatever it is: every
failure is the draw of its attempt, and the attempt that finished ended before its draw came due.
"""

import json
import os
import subprocess
import sys

from launcher import CPU_ONLY, PROJECT_ROOT, TINY, assert_ok, max_rel_diff

from parallel.reliability.chaos import draw
from parallel.reliability.job_log import read_job_log

SEED, MTBF_S, WORLD, STEPS = 162, 16.0, 2, 100
JOB = [*TINY, "parallel=dp", f"train.steps={STEPS}", "train.checkpoint_every=4"]


def test_a_chaos_job_finishes_where_its_seed_says(pools, tmp_path):
    run_dir = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "--max-restarts=5", "-m", "launch.train", *JOB, "train.resume=auto",
           f"train.chaos.mtbf_s={MTBF_S}", f"train.chaos.seed={SEED}", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_job_log(run_dir, job=_job_of(run_dir))

    # Every failure is its attempt's draw: the rank, and the time since that attempt's start.
    faults = [e for e in events if e["event"] == "fault"]
    attempts = sorted({e["attempt"] for e in events})
    assert [f["attempt"] for f in faults] == attempts[:-1] and len(faults) >= 1, faults
    for f in faults:
        expected = draw(SEED, f["attempt"], MTBF_S, WORLD)
        assert (f["rank"], f["delay_s"]) == (expected.rank, expected.delay_s)
        assert f["at"] - f["attempt_start"] >= expected.delay_s
    last = draw(SEED, attempts[-1], MTBF_S, WORLD)
    start = next(e["start"] for e in events if e["event"] == "attempt" and e["attempt"] == attempts[-1])
    end = next(e["end"] for e in events if e["event"] == "end")
    assert end - start < last.delay_s  # the attempt that finished ended before its draw came due

    # The job's losses are the uninterrupted run's (one process: the project's 1e-5 across layouts).
    reference = assert_ok(pools.run(1, [*JOB, "parallel=single"], tmp_path / "reference"))
    assert summary["first_step"] == 0 and len(summary["losses"]) == STEPS
    assert max_rel_diff(summary["losses"], reference["losses"]) < 1e-5

    # The goodput block: its parts add up to the wall time; the useful steps are the job's steps.
    g = summary["goodput"]
    assert abs(g["parts_sum_s"] - g["wall_s"]) < 1e-6 * g["wall_s"]
    assert 0 < g["useful_s"] <= g["wall_s"] and g["measured"] == g["useful_s"] / g["wall_s"]
    assert g["useful_steps"] == STEPS and g["attempts"] == len(attempts) and len(g["failures"]) == len(faults)
    assert g["parts_s"]["restart_s"] > 0
    # Without chaos a run's block has no failure and no prediction.
    assert reference["goodput"]["failures"] == [] and reference["goodput"]["predicted"] is None


def _job_of(run_dir) -> str:
    """The run id of the job that wrote the run directory's log (its last line's)."""
    return json.loads((run_dir / "job_log.jsonl").read_text().splitlines()[-1])["job"]
