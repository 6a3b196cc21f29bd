"""One rank fails, the whole job ends: non-zero, in seconds, saying which rank.

Each test makes one rank of a 2-rank run misbehave mid-run (parallel/reliability/faults.py, or a real SIGKILL
from here) and requires the torchrun job to end non-zero within 60 s with a line naming the rank.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from launcher import PROJECT_ROOT, TINY, TINY_LLAMA, run_train, train_command

LIMIT_S = 60


def _timed_run(preset: str, fault: list[str], tmp_path, extra: list[str] = (), world: int = 2, model=TINY):
    """The run, and the seconds from the injected fault to the end of the whole job."""
    run = run_train(world, [*model, f"parallel={preset}", *fault, *extra], tmp_path / "run", timeout=120)
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


# The verdict's words for the call the hung rank never posted: its op, number, group and waiters.
_NEVER_POSTED = r"rank {hung} never posted (\w+) #(\d+) of group {group} \(ranks {ranks}\); ranks {waiters} wait in it"


@pytest.mark.parametrize("preset,hung,groups,group,ranks,waiters,model", [
    # tp (dp 2 x tp 2), rank 2 hangs: rank 3 waits for it in the tp group {2, 3}, rank 0 in the dp
    # group {0, 2}, rank 1 in the dp group {1, 3} behind rank 3, itself blocked: a chain.
    ("tp", 2, r"(tp|dp) \(ranks \[\d, \d\]\)", "tp", "[2, 3]", "[3]", TINY),
    # dp (dp 4), rank 0 hangs: every other rank waits in the mesh's dp group, which spans the world
    # but is not the default group; rank 0's watcher thread still dumps and writes the verdict. On
    # Llama's block (tiny_llama), so that the mechanism is shown on both model shapes.
    ("dp", 0, r"dp \(ranks \[0, 1, 2, 3\]\)", "dp", "[0, 1, 2, 3]", "[1, 2, 3]", TINY_LLAMA),
])
def test_a_rank_hanging_inside_a_subgroup_is_named_within_the_timeout(preset, hung, groups, group, ranks, waiters,
                                                                       model, tmp_path):
    """At world 4 one rank hangs. Every group carries parallel.timeout_s (tests/layers/test_group_timeouts.py),
    so the job ends within it plus 10 s (torch's default would be 30 minutes), its first error line
    naming the subgroup it timed out in. Every rank, the hung one included, dumps its flight recorder
    (parallel/dist/flight.py) and rank 0's verdict names the hung rank, the group and the number of
    the call it never posted, which the dumps bear out: the waiter is blocked in that call, and the
    hung rank's last call on the group is the one before, the same call on both ranks."""
    timeout_s = 8
    run, elapsed = _timed_run(preset, ["train.fail_mode=hang", "train.fail_at_step=2", f"train.fail_rank={hung}"],
                              tmp_path, [f"parallel.timeout_s={timeout_s}"], world=4, model=model)
    assert run.returncode != 0
    assert elapsed < timeout_s + 10, f"a hang inside a subgroup took {elapsed:.0f} s to end the job"
    assert re.search(rf"error: rank \d stopped: .* over group {groups}.*Timed out waiting 8000ms",
                     run.stderr), run.stderr[-3000:]
    assert not (run.run_dir / "summary.json").exists()
    flight = run.run_dir / "flight"
    verdict = (flight / "verdict.txt").read_text()
    assert verdict in run.stderr + "\n" and verdict.startswith("hang verdict (rank 0, "), verdict
    named = re.search(_NEVER_POSTED.format(hung=hung, group=group, ranks=re.escape(ranks), waiters=re.escape(waiters)),
                      verdict)
    assert named, verdict
    assert json.loads((flight / "verdict.json").read_text())["culprits"] == [hung]
    dumps = {r: json.loads((flight / f"rank_{r:05d}.json").read_text()) for r in range(4)}
    op, seq, key = named.group(1), int(named.group(2)), f"{group} {ranks}"
    waiter = dumps[int(waiters.strip("[]").split(",")[0])]
    assert (waiter["blocked"]["op"], waiter["blocked"]["seq"], waiter["counters"][key]) == (op, seq, seq)
    assert dumps[hung]["blocked"] is None and dumps[hung]["counters"][key] == seq - 1
    before = [[(r["op"], r["tag"]) for r in dump["records"] if r["group"] == group and r["seq"] == seq - 1]
              for dump in (waiter, dumps[hung])]
    assert before[0] == before[1] and len(before[0]) == 1, before


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
