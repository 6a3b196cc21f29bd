"""Failure, on purpose: a testing aid, and the one-line verdict when a rank fails for real.

`train.fail_mode` with `train.fail_at_step=K` and `train.fail_rank=R` makes rank R misbehave at
step K, so the tests can prove that every way a rank can go wrong ends the whole job, non-zero,
within seconds, with a sentence that says which rank and what:

    raise             an exception in the training loop (a bug)
    exit              the process vanishes (os._exit: a segfault)
    kill              the rank SIGKILLs itself, as the OOM killer does: no exception, no exit code
    hang              the rank stops responding (a deadlock, a stuck device): its peers wait in
                      their next collective until parallel.timeout_s, then fail
    nan_weights       the rank's weights become NaN, so the loss of step K is NaN (a corrupted
                      weight, or a learning rate that blew up): the non-finite guard must stop
                      every rank before the optimizer step
    kill_during_save  rank 0 is SIGKILLed while the checkpoint taken after K steps is written,
                      after its files are on disk but before the rename that publishes it

Under restarts (torchrun --max-restarts, `train.resume=auto`) a fault must not fire again in the
attempt that replaces the one it ended: `train.fail_at_step` may be a list, its i-th entry firing in
attempt i only (`train.fail_at_step=[5,8]`: two failures in one job); `train.fail_mode` and
`train.fail_rank` are one value for every entry or a list as long. `faults_by_attempt` reads them,
and the plan keeps this attempt's entry alone. Before it fires, the failing rank appends a record
(time, rank, step, attempt, mode) to the run's recovery journal (recovery.py), which the next
attempt reads to measure what the failure cost.

Off by default (`fail_mode: null`); nothing here runs unless asked.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import torch

from parallel.dist.binding import machine_id
from parallel.dist.failures import PEER, TIMEOUT, failure_kind, failure_line

FAIL_MODES = ("raise", "exit", "hang", "nan_weights", "kill", "kill_during_save")
STEP_MODES = ("raise", "exit", "hang", "nan_weights", "kill")


class InjectedFailure(RuntimeError):
    """The exception `fail_mode=raise` throws."""


def _entries(value, count: int, name: str) -> list:
    """One value per fault: a list as long as train.fail_at_step's, or one value for all."""
    if isinstance(value, (str, int, float, type(None))):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"train.{name}={values!r} has {len(values)} entries but train.fail_at_step has {count}: "
                         "give one value for every fault, or a single value")
    return values


def faults_by_attempt(mode, at_step, fail_rank) -> list[tuple[str | None, int | None, int]]:
    """(mode, step, rank) of each attempt's fault, attempt i at index i; [] without faults."""
    if mode is None:
        return []
    steps = [at_step] if isinstance(at_step, (int, float, str, type(None))) else list(at_step)
    return list(zip(_entries(mode, len(steps), "fail_mode"), steps, _entries(fail_rank, len(steps), "fail_rank")))


def inject_before_step(mode: str | None, at_step: int | None, fail_rank: int, step: int, rank: int, params,
                       journal=None) -> None:
    """Misbehave as asked if this is the chosen rank and step; `params` are this rank's parameters;
    `journal` (recovery.py) gets the fault's record first."""
    if mode not in STEP_MODES or step != at_step or rank != fail_rank:
        return
    if journal is not None:
        journal.fault(step, mode)
    # The wall-clock time lets a test measure how long the job takes to end after the fault.
    print(f"rank {rank}: injecting train.fail_mode={mode} at step {step} (unix time {time.time():.3f})",
          file=sys.stderr, flush=True)
    if mode == "raise":
        raise InjectedFailure(f"injected failure (train.fail_mode=raise) at step {step} on rank {rank}")
    if mode == "exit":
        os._exit(13)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        while True:
            time.sleep(60)
    if mode == "nan_weights":
        with torch.no_grad():
            for p in params:
                p.fill_(float("nan"))


def kill_during_save(mode: str | None, at_step: int | None, step: int, journal=None):
    """The hook `save_checkpoint` calls between writing and publishing, or None."""
    if mode != "kill_during_save" or step != at_step:
        return None

    def kill(tmp_dir) -> None:
        if journal is not None:
            journal.fault(step, mode)
        print(f"rank 0: injecting train.fail_mode=kill_during_save: SIGKILL with {tmp_dir} written but not renamed",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def peer_table(world) -> list[tuple[str, int, str]]:
    """(hostname, pid, machine id) of every rank, on every rank (two tooling calls at start-up): the
    first two let a survivor tell which of its peers on this machine is gone; the kernel's boot id
    tells which ranks share a machine's cores (parallel/dist/binding.py)."""
    me = (socket.gethostname(), os.getpid(), machine_id())
    if world is None:
        return [me]
    table = world.gather_object(me, 0, tag="tooling/peers")
    return world.broadcast_object(table, 0, tag="tooling/peers")


def _exited(pid: int) -> bool:
    """The process is gone, or a zombie waiting for torchrun to collect its exit status."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False  # no /proc here: cannot tell


def gone_peers(table: list[tuple], rank: int, wait_s: float = 0.3) -> list[str]:
    """The ranks on this machine whose process has exited, waiting up to `wait_s` for one: a dying
    peer closes its sockets a moment before it becomes a zombie. Best effort, like every line a
    survivor prints: torchrun stops the survivors within a fraction of a second of the first
    exit (its monitor polls every 0.1 s), often before they get this far."""
    host = socket.gethostname()
    deadline = time.monotonic() + wait_s
    while True:
        gone = [f"rank {r} (pid {pid})" for r, (h, pid, *_) in enumerate(table)
                if r != rank and h == host and _exited(pid)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def describe_failure(exc: BaseException, rank: int, timeout_s: float) -> str:
    """One line for a rank that stopped on an exception: its own fault, or a peer's.

    A peer's death reaches the survivors as gloo's "Connection closed by peer" or "Connection
    reset" at once (NCCL's "remote process exited or there was a network error", where its
    transport notices); a peer that hangs, as "Timed out" after parallel.timeout_s (NCCL's
    watchdog's timeout, raised at the group's next call). parallel/dist/failures.py reads both
    backends' words into one line; the failed call is named by parallel/dist/comm.py (op, tag,
    group and, for a send or receive, the peer's rank).
    """
    text = failure_line(exc)
    kind = failure_kind(text) if isinstance(exc, RuntimeError) else None
    gone = getattr(exc, "gone_peers", None)
    if gone:
        return f"rank {rank} stopped: {', '.join(gone)} exited, so {text}"
    if kind == TIMEOUT:
        return (f"rank {rank} stopped: {text}: waited parallel.timeout_s={timeout_s:g} s "
                "for a peer rank that hangs or died (torchrun's list below gives each rank's exit)")
    if kind == PEER:
        return (f"rank {rank} stopped: {text}: a peer rank crashed or was killed "
                "(torchrun's list below gives each rank's exit)")
    return f"rank {rank} failed: {type(exc).__name__}: {text}"
