"""Failure, on purpose: a testing aid, and the one-line verdict when a rank fails for real.

`train.fail_mode` with `train.fail_at_step=K` and `train.fail_rank=R` makes rank R misbehave at
step K, so the tests can prove that every way a rank can go wrong ends the whole job, non-zero,
within seconds, with a sentence that says which rank and what:

    raise             an exception in the training loop (a bug)
    exit              the process vanishes (os._exit: a segfault, the OOM killer)
    hang              the rank stops responding (a deadlock, a stuck device): its peers wait in
                      their next collective until parallel.timeout_s, then fail
    nan_weights       the rank's weights become NaN, so the loss of step K is NaN (a corrupted
                      weight, or a learning rate that blew up): the non-finite guard must stop
                      every rank before the optimizer step
    kill_during_save  rank 0 is SIGKILLed while the checkpoint taken after K steps is written,
                      after its files are on disk but before the rename that publishes it

Off by default (`fail_mode: null`); nothing here runs unless asked.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

FAIL_MODES = ("raise", "exit", "hang", "nan_weights", "kill_during_save")
STEP_MODES = ("raise", "exit", "hang", "nan_weights")


class InjectedFailure(RuntimeError):
    """The exception `fail_mode=raise` throws."""


def inject_before_step(mode: str | None, at_step: int | None, fail_rank: int, step: int, rank: int, params) -> None:
    """Misbehave as asked if this is the chosen rank and step; `params` are this rank's parameters."""
    if mode not in STEP_MODES or step != at_step or rank != fail_rank:
        return
    # The wall-clock time lets a test measure how long the job takes to end after the fault.
    print(f"rank {rank}: injecting train.fail_mode={mode} at step {step} (unix time {time.time():.3f})", file=sys.stderr, flush=True)
    if mode == "raise":
        raise InjectedFailure(f"injected failure (train.fail_mode=raise) at step {step} on rank {rank}")
    if mode == "exit":
        os._exit(13)
    if mode == "hang":
        while True:
            time.sleep(60)
    if mode == "nan_weights":
        with torch.no_grad():
            for p in params:
                p.fill_(float("nan"))


def kill_during_save(mode: str | None, at_step: int | None, step: int):
    """The hook `save_checkpoint` calls between writing and publishing, or None."""
    if mode != "kill_during_save" or step != at_step:
        return None

    def kill(tmp_dir) -> None:
        print(f"rank 0: injecting train.fail_mode=kill_during_save: SIGKILL with {tmp_dir} written but not renamed",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def describe_failure(exc: BaseException, rank: int, timeout_s: float) -> str:
    """One line for a rank that stopped on an exception: its own fault, or a peer's.

    A peer's death reaches the survivors as gloo's "Connection closed by peer" or "Connection
    reset" at once; a peer that hangs, as "Timed out" after parallel.timeout_s. The failed call is
    named by parallel/comm.py (op, tag, group and, for a send or receive, the peer's rank).
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, RuntimeError) and "Timed out" in text:
        return (f"rank {rank} stopped: {text}: waited parallel.timeout_s={timeout_s:g} s for a peer rank that hangs or died "
                "(torchrun's list below gives each rank's exit)")
    if isinstance(exc, RuntimeError) and any(s in text for s in ("Connection closed by peer", "Connection reset", "Broken pipe")):
        return f"rank {rank} stopped: {text}: a peer rank crashed or was killed (torchrun's list below gives each rank's exit)"
    return f"rank {rank} failed: {type(exc).__name__}: {text}"
