"""Start one run as a child process, bounded in time, and stop it with everything it started.

The planner's validation (parallel/planner/validate.py), the benchmarks that launch runs
(bench/harness.py) and the sweep (launch.compare, on an emulated network or with
compare.pool=false) run `launch.train` or `launch.run` this way: each run in a session of its own,
its console saved to <run dir>/console.log, a timeout that stops torchrun and every worker below it
(Linux /proc), and the run's own one-line verdict read back from its output. `start` and `finish`
apart let a caller hold several runs in flight at once. The sweep's pool of ranks
(parallel/compare/pool.py) stops and reads its runs with the same `stop` and `error_line`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

# The directory that holds the `parallel` (and `launch`) packages: children get it on their
# PYTHONPATH, so a run started from anywhere uses this very code.
CODE_ROOT = Path(__file__).resolve().parent.parent


# torchrun's own report of a failed worker: never the cause.
LAUNCHER_NOISE = ("traceback :", "error_file", "ChildFailedError", "elastic", "FAILED", "exitcode", "Root Cause")


def error_line(stdout: str, stderr: str) -> str:
    """The run's own one-line verdict (`error: ...`) if it printed one, else the last line that names
    an error (an exception's message), else the last line of stderr."""
    lines = [line.strip() for line in (stderr + "\n" + stdout).splitlines()
             if line.strip() and not any(n in line for n in LAUNCHER_NOISE)]
    for line in lines:
        if line.startswith("error:"):
            return line[len("error:"):].strip()
    named = [line for line in lines if "Error" in line or "error" in line]
    if named:
        return named[-1]
    return lines[-1] if lines else "no output"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children first."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def stop(proc: subprocess.Popen) -> None:
    """Stop a run that outlived its timeout, and every process it started.

    torchrun, on SIGTERM, stops its workers itself; the workers run in sessions of their own, so a
    worker stuck past that grace period is then killed by its own pid, as are any left behind.
    """
    workers = descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(cmd: list[str], run_dir: Path) -> subprocess.Popen:
    """Start one run in a session of its own, so that a timeout stops torchrun and everything it
    started (see `stop`) and nothing is left behind; this code first on its PYTHONPATH."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CODE_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> tuple[str, str]:
    """Wait for a started run; returns (status, error). Output goes to <run_dir>/console.log."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        stop(proc)
        stdout, stderr = proc.communicate()
        status = "timeout"
    (run_dir / "console.log").write_text(f"$ {' '.join(proc.args)}\n{stdout}\n--- stderr ---\n{stderr}")
    if status == "ok" and not (run_dir / "summary.json").exists():
        return "failed", f"exit 0 but no summary.json: {error_line(stdout, stderr)}"
    if status == "timeout":
        return status, f"stopped after {timeout_s:g} s (compare.timeout_s)"
    if status == "failed":
        return status, f"exit {proc.returncode}: {error_line(stdout, stderr)}"
    return status, ""


def run_one(cmd: list[str], run_dir: Path, timeout_s: float) -> tuple[str, str, float]:
    """Run one strategy; returns (status, error, seconds). Output goes to <run_dir>/console.log."""
    begun = time.perf_counter()
    status, error = finish(start(cmd, run_dir), run_dir, timeout_s)
    return status, error, time.perf_counter() - begun
