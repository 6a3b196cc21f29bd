"""`train.pin_cores` (parallel/dist/binding.py), in child processes: binding moves every thread of
a process, earlier and later ones, and a temporary binding is undone; in a live run on a machine
with a core for each rank, every thread of each rank (its compute thread, gloo's event loops and
workers) is on one core, the two ranks on different ones, and `off` leaves them where the kernel
puts them (looked at from outside while the ranks train, as tests/runs/test_gloo_loop.py does)."""

import json
import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT, TINY, assert_ok, look_at_live_ranks, run_train

from parallel.dist.binding import machine_id

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"),
                       reason="binding threads to cores is Linux's"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a core per rank for 2 ranks needs 2 cores"),
]


def test_machine_id_is_the_same_in_another_process():
    """The boot id: every process of one kernel (containers and network namespaces included) reads the same."""
    child = subprocess.run([sys.executable, "-c", "from parallel.dist.binding import machine_id; print(machine_id())"],
                           capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == machine_id() != ""


BIND = """
import json, os, threading, time
from parallel.dist.binding import bind_rank, bound_to, host_cores
from parallel.report.mfu import usable_cores
def cores_of_every_thread():
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
stop = threading.Event()
early = threading.Thread(target=stop.wait)          # a thread that exists before binding (gloo's do)
early.start()
allowed = sorted(os.sched_getaffinity(0))
out = {"allowed": allowed}
with bound_to([allowed[0]]):                          # the probe's temporary binding, then back
    out["inside"] = cores_of_every_thread()
out["after"] = cores_of_every_thread()
out["said"] = bind_rank("auto", ["m", "m"], 1, 1, "cpu")  # rank 1 of 2 on this machine
late = threading.Thread(target=stop.wait)           # made after: inherits the binding
late.start()
out["bound"] = cores_of_every_thread()
out["host_cores"], out["usable_cores"] = host_cores(), usable_cores()
stop.set(); early.join(); late.join()
print(json.dumps(out))
"""


def test_binding_moves_every_thread_and_keeps_the_machines_core_count():
    proc = subprocess.run([sys.executable, "-c", BIND], capture_output=True, text=True, timeout=120,
                          cwd=PROJECT_ROOT, env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    allowed = out["allowed"]
    assert out["inside"] == [[allowed[0]]]
    assert out["after"] == [allowed]  # every thread back where it was
    assert out["said"] == f"rank 1 of this machine's 2 on core(s) {allowed[1]} of {len(allowed)}"
    assert out["bound"] == [[allowed[1]]]  # the main thread, the earlier thread and the later one
    # The machine's ranks still share all its cores: the CPU's peak is the machine's (report/mfu.py).
    assert out["host_cores"] == out["usable_cores"] == len(allowed)


def _cores_of_threads(pid: int) -> set[tuple[int, ...]]:
    """The distinct core sets of process `pid`'s threads."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except (ProcessLookupError, OSError):
            continue
    return found


def _live_cores(tmp_path, overrides: list[str]) -> tuple[dict[int, set], str]:
    """Each rank's threads' core sets once rank 0 has logged step 3, and rank 1's log."""
    return look_at_live_ranks(tmp_path / "run", overrides,
                              lambda pids: {r: _cores_of_threads(pid) for r, pid in pids.items()})


def test_each_rank_of_a_live_run_is_on_a_core_of_its_own(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    cores, logged = _live_cores(tmp_path, [])
    assert cores[0] == {(allowed[0],)}, f"rank 0's threads: {cores[0]}"
    assert cores[1] == {(allowed[1],)}, f"rank 1's threads: {cores[1]}"
    assert f"cores: rank 1 of this machine's 2 on core(s) {allowed[1]} of {len(allowed)}" in logged, logged


def test_off_leaves_the_threads_on_every_core(tmp_path):
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    cores, logged = _live_cores(tmp_path, ["train.pin_cores=off"])
    assert cores[0] == cores[1] == {allowed}
    assert "cores: off (the 2 rank(s) of this machine share its" in logged, logged


def test_round_robin_deals_the_ranks_to_the_cores_in_turn_and_the_events_say_which(tmp_path):
    """4 ranks dealt to the cores in turn: on 2 cores (more ranks than cores, where `auto` binds
    nothing) ranks 0 and 2 on the first, 1 and 3 on the second, as each rank's log and saved
    events say."""
    allowed = sorted(os.sched_getaffinity(0))
    run = run_train(4, [*TINY, "parallel=dp", "train.steps=3", "train.pin_cores=round_robin", "run.timeline=false"],
                    tmp_path / "run")
    assert_ok(run)
    for rank in range(4):
        core = allowed[rank % len(allowed)]
        events = json.loads((run.run_dir / "events" / f"rank{rank}.json").read_text())
        assert events["cores"] == [core], (rank, events["cores"])
        assert events["machine"] == machine_id()
        logged = (run.run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"on core(s) {core} of {len(allowed)} (round_robin)" in logged, logged
