"""One rank fails, the whole job ends: non-zero, in seconds, saying which rank.

Each test makes one rank of a 2-rank run misbehave mid-run (parallel/reliability/faults.py, or a real SIGKILL
from here) and requires the torchrun job to end non-zero within 60 s with a line naming the rank.
"""

import os
import re
import signal
import subprocess
import time

import pytest
from launcher import PROJECT_ROOT, TINY, run_train, train_command

LIMIT_S = 60


def _timed_run(preset: str, fault: list[str], tmp_path, extra: list[str] = (), world: int = 2):
    """The run, and the seconds from the injected fault to the end of the whole job."""
    run = run_train(world, [*TINY, f"parallel={preset}", *fault, *extra], tmp_path / "run", timeout=120)
    ended = time.time()
    injected = re.search(r"injecting train.fail_mode=\S+ at step \d+ \(unix time ([\d.]+)\)", run.stderr)
    assert injected, run.stderr[-3000:]
    elapsed = ended - float(injected.group(1))
    print(f"{preset} {fault[0]}: job ended {elapsed:.1f} s after the fault")
    return run, elapsed


@pytest.mark.parametrize("preset,mode,extra,own_line", [
    # The failing rank raises: it says so itself before it exits.
    ("dp", "raise", [],
     "error: rank 1 failed: InjectedFailure: injected failure (train.fail_mode=raise) at step 2 on rank 1"),
    # The process vanishes without a word (os._exit(13)): torchrun's list shows its exit code.
    ("tp", "exit", [], None),
    # The rank hangs: its peer waits out parallel.timeout_s in its next receive and names the peer
    # (8 s: short, yet far above any honest wait of this tiny run, start-up skew included).
    ("pp_1f1b", "hang", ["parallel.timeout_s=8"], None),
])
def test_one_failing_rank_ends_the_job(preset, mode, extra, own_line, tmp_path):
    run, elapsed = _timed_run(preset, ["train.fail_mode=" + mode, "train.fail_at_step=2", "train.fail_rank=1"],
                              tmp_path, extra)
    assert run.returncode != 0
    assert elapsed < LIMIT_S, f"{preset}/{mode} took {elapsed:.0f} s to end"
    err = run.stderr
    assert f"rank 1: injecting train.fail_mode={mode} at step 2 (unix time" in err
    if own_line:
        assert own_line in err, err[-3000:]
    if mode == "exit":
        # A vanished rank cannot speak, and its peer's own line is best effort (torchrun may stop
        # it first): torchrun's list of exits is what names the rank.
        assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: 13", err), err[-3000:]
    if mode == "hang":
        # Rank 0 of a 2-stage pipeline waits for rank 1's activation gradients: the line names both.
        assert re.search(r"error: rank 0 stopped: recv 'pp/bwd/1->0' over group pp \(ranks \[0, 1\]\) with rank 1: "
                         r"Timed out waiting 8000ms .*parallel.timeout_s=8 s", err), err[-3000:]
    assert not (run.run_dir / "summary.json").exists()


@pytest.mark.parametrize("preset,groups", [("tp", r"(tp|dp) \(ranks \[\d, \d\]\)"),
                                           ("dp", r"dp \(ranks \[0, 1, 2, 3\]\)")])
def test_a_rank_hanging_inside_a_subgroup_ends_the_job_within_the_timeout(preset, groups, tmp_path):
    """At world 4 rank 1 hangs. tp (dp 2 x tp 2): its tp partner waits in the tp group {0, 1} and the
    other tp group's ranks in the dp groups {0, 2} and {1, 3}. dp (dp 4): every other rank waits in
    the mesh's dp group, which spans the world but is not the default group. Every group carries
    parallel.timeout_s (tests/layers/test_group_timeouts.py), so the job ends within it plus 10 s, its
    first error line naming the subgroup it timed out in (torch's default would be 30 minutes)."""
    timeout_s = 8
    run, elapsed = _timed_run(preset, ["train.fail_mode=hang", "train.fail_at_step=2", "train.fail_rank=1"],
                              tmp_path, [f"parallel.timeout_s={timeout_s}"], world=4)
    assert run.returncode != 0
    assert elapsed < timeout_s + 10, f"a hang inside a subgroup took {elapsed:.0f} s to end the job"
    assert re.search(rf"error: rank \d stopped: .* over group {groups}.*Timed out waiting 8000ms",
                     run.stderr), run.stderr[-3000:]
    assert not (run.run_dir / "summary.json").exists()


def test_sigkill_of_a_worker_ends_the_job(tmp_path):
    """A real SIGKILL from outside: the pid comes from the rank's own log header."""
    run_dir = tmp_path / "run"
    cmd = train_command(2, [*TINY, "parallel=dp", "train.steps=400", f"run.dir={run_dir}"])
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        pid = None
        while time.monotonic() < deadline and proc.poll() is None:
            logs = {r: (run_dir / "logs" / f"rank{r}.log") for r in (0, 1)}
            if all(p.exists() for p in logs.values()):
                found = re.search(r"rank 1 pid (\d+)", logs[1].read_text())
                if found and "step    1 |" in logs[0].read_text():
                    pid = int(found.group(1))
                    break
            time.sleep(0.2)
        assert pid is not None, "the run never reached step 1"
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < LIMIT_S, f"took {elapsed:.0f} s to end after the kill"
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9", err), err[-3000:]
    assert "Signal 9 (SIGKILL)" in err
    print(f"job ended {elapsed:.1f} s after SIGKILL of rank 1")


def test_nan_loss_stops_every_rank_before_the_optimizer(tmp_path):
    """Rank 1's weights turn NaN before step 2: rank 0's loss share is finite, but the all-reduced
    flag stops both ranks at step 2, each saying so in its log."""
    run, elapsed = _timed_run("dp", ["train.fail_mode=nan_weights", "train.fail_at_step=2", "train.fail_rank=1"],
                              tmp_path)
    assert run.returncode != 0
    assert re.search(r"exitcode\s*: 3 ", run.stderr), run.stderr[-3000:]  # our status for a non-finite loss
    assert elapsed < LIMIT_S
    assert "error: non-finite loss at step 2 (this rank's share of the loss is " in run.stderr, run.stderr[-3000:]
    for rank in (0, 1):
        log = (run.run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "error: non-finite loss at step 2" in log and "stopped before the optimizer step" in log
    # Steps 0 and 1 ran and were logged; step 2 never was.
    assert [m["step"] for m in run.metrics()] == [0, 1]
