"""Chaos mode: failures at random, as a large cluster has them, but reproducible from a seed.

`train.chaos.mtbf_s=M train.chaos.seed=S`: in each attempt of a job (the plan's attempt number,
resume.py: 0 for the first, 1 after one restart, ...) every rank draws the same
two numbers from (S, attempt): a time to failure, exponential with mean M seconds, and a rank.
That rank starts a daemon timer at start-up and SIGKILLs itself when its process has lived that
long, wherever it then is: in a step, in a save, in the set-up, as a real failure lands. The
next attempt draws afresh, so the failures of a whole job follow from the seed alone (their
times since each attempt's start and their ranks; the step they land in depends on the
machine's speed). Exponential times since each start are a Poisson process of rate 1/M over the
time the processes live, the model's assumption (parallel/reliability/goodput.py).

Off by default (`mtbf_s: null`). Run it under `torchrun --max-restarts=N` with
`train.resume=auto` and checkpoints, or every failure ends the job.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

from parallel.reliability.job_log import JobLog
from parallel.reliability.recovery import process_start_time


@dataclass(frozen=True)
class ChaosDraw:
    """One attempt's failure: after `delay_s` seconds of the attempt, rank `rank` dies."""

    attempt: int
    delay_s: float
    rank: int


def draw(seed: int, attempt: int, mtbf_s: float, world_size: int) -> ChaosDraw:
    """The same on every rank and in every run: a generator seeded by (seed, attempt) only."""
    rng = random.Random(f"chaos:{seed}:{attempt}")
    return ChaosDraw(attempt=attempt, delay_s=rng.expovariate(1.0 / mtbf_s), rank=rng.randrange(world_size))


def arm(mtbf_s: float | None, seed: int, rank: int, world_size: int, job: JobLog) -> ChaosDraw | None:
    """Start this attempt's timer if this rank is the one drawn; returns the draw (None: chaos off)."""
    if mtbf_s is None:
        return None
    chosen = draw(seed, job.attempt, mtbf_s, world_size)
    if chosen.rank == rank:
        started = process_start_time()
        wait = max(0.0, started + chosen.delay_s - time.time())
        timer = threading.Timer(wait, _die, args=(chosen, started, job))
        timer.daemon = True  # a finished run leaves without waiting for it
        timer.start()
    return chosen


def open_job(plan, rank: int) -> JobLog:
    """This attempt's job log (its file once the run directory is known: `JobLog.bind`), with
    chaos's timer armed before anything else, so a failure can land in the set-up too."""
    job = JobLog(plan.run_dir, rank, plan.start_step, plan.attempt)  # None until rank 0 names it, unless run.dir does
    arm(plan.chaos_mtbf_s, plan.chaos_seed, rank, plan.dims.world_size, job)
    return job


def chaos_error(section) -> str | None:
    """What is wrong with `train.chaos` (None: nothing), checked before any process group."""
    mtbf, seed = section.get("mtbf_s"), section.get("seed", 0)
    if mtbf is not None and (isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or not mtbf > 0):
        return (f"train.chaos.mtbf_s={mtbf!r} must be a positive number of seconds (the mean time between "
                "failures), or null (no chaos)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        return f"train.chaos.seed={seed!r} must be an integer >= 0"
    return None


def _die(chosen: ChaosDraw, started: float, job: JobLog) -> None:
    """The fault: recorded, said on stderr, then SIGKILL (no handler, no flush, no goodbye)."""
    now = time.time()
    job.fault(kind="chaos", rank=chosen.rank, at=now, attempt_start=started, delay_s=chosen.delay_s)
    print(f"rank {chosen.rank}: chaos: SIGKILL in attempt {chosen.attempt}, {now - started:.2f} s after its start "
          f"(drawn {chosen.delay_s:.2f} s; unix time {now:.3f})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
