"""Run `launch.train` as a user would: plain python for one process, torchrun for several.

Every multi-process run uses `--standalone` (a free rendezvous port picked by the OS, never a
fixed one) and a hard timeout, so a hang fails the test instead of stalling the suite.

`run_nodes` starts several torchrun agents on this machine as the nodes of one job, with the
command line a cluster uses (`multinode_command`: c10d rendezvous on HOST:PORT, one job id).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from parallel.compare.pool import Pool, pools_supported

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Virtual time's loopback link, given rather than probed: a run probes it itself when these are null
# (two ranks bound to a core each, about a second of a 4-rank run's 7 on 2 cores), and the figures
# only scale the virtual block, which the tests check for consistency, not for its value. These are
# a probe's median on a 2-core machine (docs/virtual-time.md); test_replay.py's run probes its own.
GIVEN_LOOPBACK = ["virtual.loopback_gbytes_per_s=1.62", "virtual.loopback_latency_us=180",
                  "virtual.loopback_p2p_latency_us=127"]

# The settings every correctness test shares: the tiny model, a few steps, a small batch.
# MFU's peak is given rather than measured (a quarter second of matmuls per run; test_mfu.py and the
# compare test measure it), and so is the loopback (GIVEN_LOOPBACK). trace.json is written by every
# run; timeline.png (a second of matplotlib) is drawn only where a test looks at it (run.timeline=true).
TINY = ["model=tiny", "train.steps=6", "train.warmup_steps=1", "train.global_batch=16", "data.max_bytes=1000000",
        "train.peak_flops=1e11", "run.timeline=false", *GIVEN_LOOPBACK]
# The same on Llama's block (conf/model/tiny_llama.yaml: GQA, SwiGLU, RMSNorm, RoPE, no bias).
TINY_LLAMA = ["model=tiny_llama" if arg == "model=tiny" else arg for arg in TINY]


def tiny_settings(overrides: list[str]) -> list[str]:
    """TINY's settings, then `overrides`; a `model=` preset among them takes the place of TINY's
    (Hydra refuses a config group chosen twice)."""
    models = [o for o in overrides if o.startswith("model=")]
    return [*models, *TINY[1:], *(o for o in overrides if o not in models)] if models else [*TINY, *overrides]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def summary(self) -> dict:
        path = self.run_dir / "summary.json"
        assert path.exists(), (f"no summary.json (exit {self.returncode})\n"
                               f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}")
        return json.loads(path.read_text())

    @property
    def final_params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "final_model.pt")

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def train_command(nproc: int, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "launch.train", *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "launch.train", *overrides,
    ]


# The CPU suite runs on the CPU even where a GPU is visible (its 1e-5 comparisons are CPU against
# CPU, and NCCL would need a GPU per rank); the GPU-marked tests pass gpu=True.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def run_train(nproc: int, overrides: list[str], run_dir: Path, timeout: float = 240, env: dict | None = None,
              gpu: bool = False) -> Run:
    cmd = train_command(nproc, [*overrides, f"run.dir={run_dir}"])
    proc = subprocess.run(
        cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **({} if gpu else CPU_ONLY), **(env or {})},
    )
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


class RunPools:
    """Runs a test expects to succeed, forked from one waiting pool of ranks per world size
    (parallel/compare/pool.py, launch/forkserver.py) instead of a fresh torchrun each: the imports
    of torch and Hydra are paid once per world for the whole session, not once per run. A pooled
    run is the fresh run to the bit (tests/tools/test_compare_pool.py: losses, bytes, summary,
    files, peak memory); its console is in <run dir>/console.log, stdout then stderr. A run that
    fails ends its pool, and the next run of that world starts a new one. At most `KEEP` pools wait
    at once (each rank holds its imports in memory): a new world ends the pool used longest ago.
    Runs that check an exit status, a signal, torchrun's own output, or need another environment
    use `run_train`."""

    KEEP = 3  # worlds 1, 2 and 4 stay warm; a run at world 3 or 8 ends the one used longest ago

    def __init__(self):
        self.pools: dict[int, Pool] = {}  # in order of use, the latest last

    def run(self, nproc: int, overrides: list[str], run_dir: Path, timeout: float = 240) -> Run:
        if not pools_supported():
            return run_train(nproc, overrides, run_dir, timeout)
        pool = self.pools.pop(nproc, None)
        if pool is not None and not pool.alive:
            pool.close()
            pool = None
        if pool is None:
            while len(self.pools) >= self.KEEP:
                self.pools.pop(next(iter(self.pools))).close()
            with mock.patch.dict(os.environ, CPU_ONLY):  # the pool's ranks inherit it: gloo on the CPU
                pool = Pool(nproc)
        self.pools[nproc] = pool
        status, error, _ = pool.run(train_command(nproc, overrides), [*overrides, f"run.dir={run_dir}"], run_dir,
                                    timeout)
        console = (run_dir / "console.log").read_text()
        stdout, _, stderr = console.partition("\n--- stderr ---\n")
        code = re.match(r"exit (-?\d+)", error)
        return Run(0 if status == "ok" else int(code.group(1)) if code else 1, stdout, stderr or error, run_dir)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools = {}


def assert_ok(run: Run) -> dict:
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    return run.summary


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def check_matches_single(run, single_run, rtol=1e-5):
    s, ref = run.summary, single_run.summary
    assert len(s["losses"]) == len(ref["losses"]) == 6
    diff = max_rel_diff(s["losses"], ref["losses"])
    assert diff < rtol, f"losses differ by {diff:.2e} relative\n{s['losses']}\n{ref['losses']}"
    params, ref_params = run.final_params, single_run.final_params
    assert params.keys() == ref_params.keys()
    # Parameters: rtol 1e-5 plus an absolute 1e-5, 1% of one learning-rate step. Adam divides each
    # gradient by its own running magnitude, so where a gradient is close to zero (the attention
    # key bias has a true gradient of exactly zero: softmax ignores a constant added to a row of
    # scores) a rounding-level difference in summation order becomes a visible fraction of lr.
    lr = run.summary["config"]["train"]["lr"]
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-2 * lr,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert [m["data_checksum"] for m in run.metrics()] == [m["data_checksum"] for m in single_run.metrics()]



def check_step0_grads_match(run, single_run) -> dict:
    """Step 0's synced gradients (train.save_grads=true, gathered to full tensors) equal the single
    run's, and the run's saved dict is returned for further checks.

    rtol 1e-5 as for the losses; atol 1e-6 (the largest gradient is ~0.5, so 2e-6 of it) for entries
    whose true value is zero or nearly so (the key bias: softmax ignores a constant per row), where
    only the summation order differs (partial sums across ranks)."""
    mine, ref = torch.load(run.run_dir / "grads_step0.pt"), torch.load(single_run.run_dir / "grads_step0.pt")
    assert mine["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(mine["grads"][name], g, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return mine


# -- several torchrun agents as the nodes of one job ------------------------------------------------

def multinode_command(nnodes: int, nproc_per_node: int, rdzv_endpoint: str, rdzv_id: str, overrides: list[str],
                      python: str = sys.executable) -> list[str]:
    """One node's torchrun command line, as on a cluster: every node runs the same command and
    the c10d rendezvous on `rdzv_endpoint` numbers the nodes (and so the global ranks)."""
    return [
        python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
        "-m", "launch.train", *overrides,
    ]


def free_port() -> int:
    """A port free right now; the rendezvous binds it a moment later (the first agent to try
    becomes the store's server, the other its client)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeRun:
    """One agent's outcome; `workdir` is its current directory (its `runs/` lives there)."""

    returncode: int | None  # None: killed after the deadline
    stdout: str
    stderr: str
    workdir: Path


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first: the agent then stops its workers (they run in sessions of their own, so a
    signal to the agent's process group would miss them); SIGKILL if it does not go."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_nodes(nproc_per_node: int, overrides: list[str], workdirs: list[Path], timeout: float = 120,
              env: dict | None = None) -> list[NodeRun]:
    """Run one job as len(workdirs) nodes on this machine, agent k in workdirs[k].

    Separate working directories stand for nodes without a shared filesystem: each node's ranks
    write their logs under its own `runs/`, and only the node that got global rank 0 holds the
    summary. Loopback rendezvous on a free port; GLOO_SOCKET_IFNAME=lo, as a user sets the
    interface on a cluster. As soon as one agent fails, or at the deadline, every agent is stopped.
    """
    endpoint, job = f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex[:8]}"
    pythonpath = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, **CPU_ONLY, "PYTHONPATH": pythonpath, "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    cmd = multinode_command(len(workdirs), nproc_per_node, endpoint, job, overrides)
    procs, outputs, codes = [], [], []
    try:
        for workdir in workdirs:
            workdir.mkdir(parents=True, exist_ok=True)
            out, err = open(workdir / "agent.out", "w"), open(workdir / "agent.err", "w")
            outputs.append((out, err))
            procs.append(subprocess.Popen(cmd, cwd=workdir, env=full_env, stdout=out, stderr=err, text=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]  # None: still running, about to be stopped
    finally:
        for proc in procs:
            _stop(proc)
        for out, err in outputs:
            out.close()
            err.close()
    return [NodeRun(code, (w / "agent.out").read_text(), (w / "agent.err").read_text(), w)
            for code, w in zip(codes, workdirs)]


def look_at_live_ranks(run_dir: Path, overrides: list[str], look, at_step: int = 3, timeout: float = 120):
    """Start a 2-rank run of 400 steps, wait until rank 0 has logged step `at_step` (past warm-up),
    call `look({rank: pid})` on the live ranks from outside, stop the run, and return what `look`
    returned with rank 1's log: for what only a running rank shows (its threads' policies, cores)."""
    cmd = train_command(2, [*TINY, "parallel=dp", "train.steps=400", "train.warmup_steps=2", f"run.dir={run_dir}",
                            *overrides])
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **CPU_ONLY})
    try:
        deadline, pids = time.monotonic() + timeout, {}
        logs = {r: run_dir / "logs" / f"rank{r}.log" for r in (0, 1)}
        while time.monotonic() < deadline and proc.poll() is None and len(pids) < 2:
            if all(p.exists() for p in logs.values()) and f"step {at_step:4d} |" in logs[0].read_text():
                for r, path in logs.items():
                    found = re.search(rf"rank {r} pid (\d+)", path.read_text())
                    if found:
                        pids[r] = int(found.group(1))
            time.sleep(0.2)
        assert len(pids) == 2, f"the run never reached step {at_step}"
        seen = look(pids)
        logged = logs[1].read_text()
    finally:
        # SIGTERM: torchrun stops its workers and waits for them (SIGKILL would leave them training on).
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=60)
    return seen, logged
