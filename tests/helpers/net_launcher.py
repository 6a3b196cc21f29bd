"""Run `launch.run` as a user would, and tell whether this machine can emulate a network.

Emulated networks need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2. Where they are
missing the tests skip with the reason; CI runs as root and sets PARALLEL_NET_REQUIRED=1
(.ci/run), which turns that skip into a failure, so the tests cannot pass there by not running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT, Run

from parallel.net.netns import list_namespaces
from parallel.net.topology import owner_of


def why_not_available(tools: tuple[str, ...] = ("ip", "tc")) -> str | None:
    """Why this machine cannot make network namespaces with `tools` (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "network namespaces need root (namespaces, veth links, tc)"
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"network namespaces need iproute2: {' and '.join(missing)} not on PATH"
    probe = f"pnet{os.getpid()}-sw"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


WHY_NOT = why_not_available()


def require_network(why_not: str | None = WHY_NOT) -> None:
    """Skip (or, under PARALLEL_NET_REQUIRED=1, fail) where no network can be emulated (`why_not`)."""
    if why_not is None:
        return
    if os.environ.get("PARALLEL_NET_REQUIRED") == "1":
        pytest.fail(f"PARALLEL_NET_REQUIRED=1 but {why_not}")
    pytest.skip(why_not)


def run_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "launch.run", *overrides]


def run_net(overrides: list[str], run_dir: Path, timeout: float = 240) -> Run:
    proc = subprocess.run(run_command([*overrides, f"run.dir={run_dir}"]), cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **CPU_ONLY})
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def start_net(overrides: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    """launch.run in the background (its output in `log`), to be interrupted or broken mid-run."""
    out = open(log, "w")
    return subprocess.Popen(run_command([*overrides, f"run.dir={run_dir}"]), cwd=PROJECT_ROOT, stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, **CPU_ONLY}, text=True)


def launcher_pid(output: str) -> int | None:
    """The pid launch.run names its network after, from the line it prints when it builds it."""
    m = re.search(r"launch\.run: network .* launcher pid (\d+)", output)
    return int(m.group(1)) if m else None


def namespaces_of(pid: int) -> list[str]:
    return [ns for ns in list_namespaces() if owner_of(ns) == pid]


def wait_until(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until rank 0 has logged `step` (training is under way on every node)."""
    metrics = run_dir / "metrics.jsonl"

    def reached():
        assert proc.poll() is None, f"launch.run ended early (exit {proc.returncode})"
        return metrics.exists() and sum(1 for _ in metrics.open()) > step

    wait_until(reached, timeout, f"step {step} in {metrics}")


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def processes_in(namespaces: list[str]) -> list[int]:
    pids = []
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids += [int(p) for p in out.split()]
    return pids


def worker_pids(namespace: str) -> list[int]:
    """The training processes (not the torchrun agent) inside one node's namespace."""
    pids = []
    for pid in processes_in([namespace]):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"launch.train" in cmdline and b"torch.distributed.run" not in cmdline:
            pids.append(pid)
    return pids


def assert_nothing_left(owner_pid: int, pids_seen: list[int] = ()) -> None:
    """No namespace named after `owner_pid`, and none of `pids_seen` (its processes) still running."""
    wait_until(lambda: not namespaces_of(owner_pid), 15, f"the namespaces of launcher {owner_pid} to be deleted")
    wait_until(lambda: not [p for p in pids_seen if process_alive(p)], 15, "the job's processes to end")


