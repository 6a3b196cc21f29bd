"""The sweep's pool of ranks: every run of one world forked from processes that started once.

A run started as a fresh `torchrun ... -m launch.train` spends seconds before its first step:
torchrun's agent and every rank start an interpreter and import torch and Hydra, and on a
machine with fewer cores than ranks those imports queue for the cores. A sweep pays that once
per strategy. A `Pool` pays it once per world: it starts one torchrun of `world` ranks, each
running launch/forkserver.py, which imports launch.train and then waits on a pipe. Each `run`
sends every rank the run's overrides; each rank forks, and the fork is launch.train on them.

What a run sees is what a fresh launch.train sees: the same torchrun environment, its own
process (nothing of an earlier strategy is held: the forking parent never runs one), its own
process groups on a store opened for it alone (the address travels with the job), its own run
directory, logs, metrics and summary.json, and its console (stdout, then stderr, with whatever
torchrun said meanwhile) in <run dir>/console.log. The run's timeout bounds it as before: past
it, the pool is stopped with everything it started (parallel/runner.py) and the next run starts
a new pool; so does any failed run, since a failed rank ends its forking parent and torchrun
stops the others. `run` returns what runner.run_one returns: (status, error, seconds).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.runner import CODE_ROOT, error_line, stop

STOP_WAIT_S = 30.0  # how long a pool told to end may take before it is stopped
JOBS, DONE = "jobs{rank}", "done"  # the pool directory's pipes: one per rank from the sweep, one back


class Pool:
    """`world` waiting ranks under one torchrun (one plain process for a world of one)."""

    def __init__(self, world: int):
        self.world = world
        self.dir = Path(tempfile.mkdtemp(prefix="compare-pool-"))
        for rank in range(world):
            os.mkfifo(self.dir / JOBS.format(rank=rank))
        os.mkfifo(self.dir / DONE)
        # Read-write ends: opening them never blocks, and the ranks see the end of their pipe
        # only when the sweep closes it (or dies).
        self._jobs = [os.open(self.dir / JOBS.format(rank=rank), os.O_RDWR) for rank in range(world)]
        self._done = os.open(self.dir / DONE, os.O_RDWR | os.O_NONBLOCK)
        self._console = {name: self.dir / f"pool.{name}" for name in ("stdout", "stderr")}
        self._read_to = dict.fromkeys(self._console, 0)
        files = {name: open(path, "w") for name, path in self._console.items()}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CODE_ROOT),
                                                                         os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(self.command(), env=env, stdout=files["stdout"], stderr=files["stderr"],
                                     start_new_session=True)
        for f in files.values():
            f.close()
        self._exited = os.pidfd_open(self.proc.pid)
        self._jobs_sent = 0
        self._pending = b""

    def command(self) -> list[str]:
        server = ["-m", "launch.forkserver", str(self.dir)]
        if self.world == 1:
            return [sys.executable, *server]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.world}",
                *server]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, cmd: list[str], overrides: list[str], run_dir: Path, timeout_s: float) -> tuple[str, str, float]:
        """One run on every rank of the pool; `cmd` is the fresh command it stands for (console.log's
        first line). After a failure or a timeout the pool is gone: `alive` is False."""
        from torch.distributed import TCPStore

        run_dir.mkdir(parents=True, exist_ok=True)
        job_id, self._jobs_sent = self._jobs_sent, self._jobs_sent + 1
        console = {name: self.dir / f"job{job_id}.{name}" for name in ("stdout", "stderr")}
        start = time.perf_counter()
        # The run's own rendezvous; the sweep keeps it open until every rank is done.
        store = TCPStore("127.0.0.1", 0, self.world, True, wait_for_workers=False) if self.world > 1 else None
        job = {"id": job_id, "overrides": overrides, "master_addr": "127.0.0.1",
               "master_port": store.port if store else None, **{k: str(v) for k, v in console.items()}}
        line = (json.dumps(job) + "\n").encode()
        for fd in self._jobs:
            os.write(fd, line)
        codes = self._wait(job_id, time.monotonic() + timeout_s)
        status = "timeout" if codes is None else "ok" if codes == [0] * self.world else "failed"
        if status == "failed":
            self._end(time.monotonic() + STOP_WAIT_S)
        elif status == "timeout":
            stop(self.proc)
        del store
        seconds = time.perf_counter() - start
        stdout, stderr = (self._read(console[name]) + self._pool_output(name) for name in ("stdout", "stderr"))
        (run_dir / "console.log").write_text(f"$ {' '.join(cmd)}\n# forked in the sweep's pool of ranks "
                                             f"(parallel/compare/pool.py): the run this command starts\n"
                                             f"{stdout}\n--- stderr ---\n{stderr}")
        if status == "ok" and not (run_dir / "summary.json").exists():
            return "failed", f"exit 0 but no summary.json: {error_line(stdout, stderr)}", seconds
        if status == "timeout":
            return status, f"stopped after {timeout_s:g} s (compare.timeout_s)", seconds
        if status == "failed":
            code = self.proc.returncode if self.proc.returncode is not None else next(c for c in codes if c)
            return status, f"exit {code}: {error_line(stdout, stderr)}", seconds
        return status, "", seconds

    def _wait(self, job_id: int, deadline: float) -> list[int] | None:
        """Every rank's exit status for the job (a rank that never said: 1, when the pool ended
        first), or None when the deadline passed."""
        codes: dict[int, int] = {}
        while len(codes) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self._done, self._exited], [], [], remaining)
            if self._done in ready:
                codes.update(self._reports(job_id))
            elif self._exited in ready:
                codes.update(self._reports(job_id))
                return [codes.get(rank, 1) for rank in range(self.world)]
            if any(codes.values()):
                return [codes.get(rank, 1) for rank in range(self.world)]
        return [codes[rank] for rank in range(self.world)]

    def _reports(self, job_id: int) -> dict[int, int]:
        """The `<job> <rank> <exit status>` lines written back so far, for this job."""
        try:
            self._pending += os.read(self._done, 1 << 16)
        except BlockingIOError:
            return {}
        *lines, self._pending = self._pending.split(b"\n")
        found = {}
        for line in lines:
            job, rank, code = map(int, line.split())
            if job == job_id:
                found[rank] = code
        return found

    def _read(self, path: Path) -> str:
        if not path.exists():
            return ""
        text = path.read_text(errors="replace")
        path.unlink()
        return text

    def _pool_output(self, name: str) -> str:
        """What torchrun (or a rank outside its runs) printed since the last run's output was read."""
        with open(self._console[name], errors="replace") as f:
            f.seek(self._read_to[name])
            text = f.read()
            self._read_to[name] = f.tell()
        return text

    def _end(self, deadline: float) -> None:
        """Wait for the pool to end by itself until `deadline`, then stop it and everything below it."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop(self.proc)

    def close(self, at_once: bool = False) -> None:
        """End the pool: each rank sees its pipe end and leaves (`at_once`: the pool is stopped, with
        any run in it, as when the sweep itself is interrupted); remove its directory."""
        for fd in self._jobs:
            os.close(fd)
        self._jobs = []
        if self.alive:
            self._end(time.monotonic() + (0.0 if at_once else STOP_WAIT_S))
        os.close(self._done)
        os.close(self._exited)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(at_once=kind is not None)


def pools_supported() -> bool:
    """The pool needs Linux: named pipes, fork, a pid file descriptor and /proc/self/pagemap."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(os, "fork")


class Pools:
    """The pool of the world the sweep runs at now: started at its first run, and again after a run
    that ended it or when the world changes (the pool of the world before is ended first, so that
    one pool at a time shares the machine with the run, as one torchrun did). `close` (or the
    `with` block) ends the last."""

    def __init__(self):
        self._pool: Pool | None = None

    def run(self, world: int, cmd: list[str], overrides: list[str], run_dir: Path,
            timeout_s: float) -> tuple[str, str, float]:
        if self._pool is not None and (self._pool.world != world or not self._pool.alive):
            self.close()
        if self._pool is None:
            self._pool = Pool(world)
        return self._pool.run(cmd, overrides, run_dir, timeout_s)

    def close(self, at_once: bool = False) -> None:
        if self._pool is not None:
            self._pool.close(at_once)
            self._pool = None

    def __enter__(self) -> Pools:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(at_once=kind is not None)
