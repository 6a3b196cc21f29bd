"""Emulated networks that break, and the tool that must leave nothing behind however a job ends.

  - a link that goes down mid-run ends the job within the collective timeout, with one line that
    names the unreachable node and its rank;
  - Ctrl-C of launch.run, and a rank SIGKILLed mid-run: the job ends, and no namespace (so no veth
    or bridge: they live only inside them) and none of the job's processes is left;
  - launch.run itself SIGKILLed: its reaper deletes the network;
  - a namespace left by a launcher that no longer runs is removed at the next start.

Cost: 4 jobs of 35-55 s on a shared 2-core machine (the link-down one waits out a 5 s collective
timeout), and one namespace made by hand.
"""

import os
import signal
import subprocess

from launcher import TINY
from net_launcher import (
    assert_nothing_left,
    launcher_pid,
    namespaces_of,
    processes_in,
    require_network,
    run_net,
    start_net,
    wait_for_step,
    wait_until,
    worker_pids,
)

from parallel.net.netns import list_namespaces, remove_leftovers
from parallel.net.topology import Names

# A job long enough to be interrupted mid-run: dp over a slow link (~0.1 s a step).
LONG = [*TINY, "net=ethernet_1g", "net.inter_mbit=50", "parallel=dp", "train.steps=200"]


def _launcher_pid_from(log) -> int:
    return wait_until(lambda: launcher_pid(log.read_text()), 60, "launch.run to build its network")


def test_link_down_ends_the_job_naming_the_unreachable_node(tmp_path):
    require_network()
    timeout_s = 5
    run = run_net([*TINY, "net=ethernet_1g", "parallel=dp", "train.steps=30", f"parallel.timeout_s={timeout_s}",
                   "link_fault.kind=down", "link_fault.at_step=2"], tmp_path / "run", timeout=180)
    assert run.returncode not in (0, None)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: node 1 (198.18.0.101, rank 1) is unreachable: its link is down"), run.stderr[-3000:]
    # The job's first agent failed within the collective timeout (plus torchrun's 1 s monitor
    # interval and start-up slack), not minutes later.
    delay = float(last.split("the first agent failed ")[1].split(" s later")[0])
    assert delay < timeout_s + 5, last
    assert not namespaces_of(launcher_pid(run.stderr))


def test_ctrl_c_of_launch_run_removes_everything(tmp_path):
    require_network()
    log = tmp_path / "launch.log"
    proc = start_net(LONG, tmp_path / "run", log)
    try:
        pid = _launcher_pid_from(log)
        wait_for_step(tmp_path / "run", 2, proc)
        seen = processes_in([Names(pid, 2).node(k) for k in range(2)])
        assert seen
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGINT, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by SIGINT" in log.read_text()
    assert_nothing_left(pid, seen)


def test_a_rank_killed_mid_run_ends_the_job_and_leaves_nothing(tmp_path):
    require_network()
    log = tmp_path / "launch.log"
    proc = start_net(LONG, tmp_path / "run", log)
    try:
        pid = _launcher_pid_from(log)
        wait_for_step(tmp_path / "run", 2, proc)
        seen = processes_in([Names(pid, 2).node(k) for k in range(2)])
        victim = worker_pids(Names(pid, 2).node(1))
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert code not in (0, None), output[-3000:]
    # Every node still reaches every other: the network is not blamed for a dead process.
    assert "the network is not the cause" in output.strip().splitlines()[-1], output[-3000:]
    assert_nothing_left(pid, seen)


def test_a_killed_launcher_is_cleaned_up_by_its_reaper(tmp_path):
    require_network()
    log = tmp_path / "launch.log"
    proc = start_net(LONG, tmp_path / "run", log)
    try:
        pid = _launcher_pid_from(log)
        wait_for_step(tmp_path / "run", 1, proc)
        seen = processes_in([Names(pid, 2).node(k) for k in range(2)])
        proc.kill()  # SIGKILL: no handler, no __exit__
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_nothing_left(pid, seen)


def test_leftovers_of_a_dead_launcher_are_removed_at_the_next_start():
    require_network()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    left = Names(dead.pid, 1)
    for ns in left.namespaces:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "-n", left.switch, "link", "add", "br0", "type", "bridge"], check=True)
    alive = Names(os.getpid(), 1).switch  # a namespace whose launcher (this process) still runs
    subprocess.run(["ip", "netns", "add", alive], check=True)
    try:
        removed = remove_leftovers()
        assert sorted(removed) == sorted(left.namespaces)
        assert not [ns for ns in list_namespaces() if ns in left.namespaces]
        assert alive in list_namespaces()
    finally:
        for ns in [*left.namespaces, alive]:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
