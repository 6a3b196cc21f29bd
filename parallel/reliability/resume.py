"""`train.resume=auto`: one job, several attempts, one run directory.

A job that torchrun restarts (`--max-restarts=N`), or that Slurm requeues, starts its processes
again with the same command line. For the new attempt to continue where the last one stopped, it
must look in the same place, so `resume=auto` needs a run directory that every attempt of the job
names alike:

    run.dir given              that directory
    run.dir null, under Slurm  runs/job-<SLURM_JOB_ID>-<strategy>-w<world>   (kept across requeues)
    run.dir null, torchrun     runs/job-<TORCHELASTIC_RUN_ID>-<strategy>-w<world>   (the rendezvous id:
                               the same in every attempt of one torchrun, --standalone included)
    neither                    refused: a plain `python -m launch.train` is never restarted, so
                               it would always start afresh in a new directory

The checkpoints are then train.checkpoint_dir, else <run dir>/checkpoints; the newest complete
one is resumed (resolve_checkpoint: unfinished `*.tmp-*` directories are ignored) and, where
there is none, the job starts from step 0. Which of the two happened is logged.

An attempt's number is how many attempts of the job came up before it: rank 0 of each attempt of
a `resume=auto` job appends a `started` record to the run's recovery journal (recovery.py) once
its process groups are up, and every rank of the next attempt counts those records while it builds
its plan, before any group exists (so before this attempt's own record). torchrun's
TORCHELASTIC_RESTART_COUNT alone would not do: a Slurm requeue and a node agent that launch.run
replaces count from 0 again, while the job has had attempts before. Without `resume=auto` the
number is torchrun's count (0 without torchrun). The fault injection uses it to fire each fault in
one attempt only (faults.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from parallel.reliability.checkpoint import CheckpointError, read_meta, resolve_checkpoint
from parallel.reliability.recovery import STARTED, Journal
from parallel.reliability.sharded import load_state
from parallel.spec import ConfigError

AUTO = "auto"


def attempt_number(run_dir: str | None = None, environ=os.environ) -> int:
    """0 for the first attempt of a job, 1 after its first restart, and so on: the `started`
    records in the job's journal where `run_dir` (a resume=auto job's) is given, else torchrun's count.

    With a journal, torchrun's count is still a floor: an attempt that died in its set-up, before
    rank 0 wrote `started`, left no record, and counting records alone would give the next attempt
    the failed one's number (and a chaos draw or a fault list would strike it again). The journal
    is what counts past a Slurm requeue or a replaced node agent, where torchrun's count restarts."""
    restarts = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if run_dir is None:
        return restarts
    return max(restarts, sum(r["event"] == STARTED for r in Journal(run_dir, rank=0, attempt=0).records()))


def job_identity(environ=os.environ) -> str | None:
    """What names this job in every one of its attempts: Slurm's job id (a requeue keeps it; the
    sbatch script also passes it to torchrun as the rendezvous id), else torchrun's run id."""
    return environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or None


def job_run_dir(run_dir: str | None, strategy: str, world_size: int, environ=os.environ) -> str:
    """The run directory of a `resume=auto` job, the same in each attempt (see the table above)."""
    if run_dir is not None:
        return run_dir
    job = job_identity(environ)
    if job is None:
        raise ConfigError(
            "train.resume=auto needs a run directory that every attempt of the job shares: set run.dir=<dir> "
            "(or launch under torchrun or Slurm, whose job id names one)"
        )
    return os.path.join("runs", f"job-{job}-{strategy}-w{world_size}")


def checkpoint_root(checkpoint_dir: str | None, run_dir: str | Path) -> Path:
    """Where the checkpoints of a run go: train.checkpoint_dir, else <run dir>/checkpoints."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


def newest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None where there is none yet."""
    if not root.is_dir():
        return None
    try:
        return resolve_checkpoint(str(root))
    except CheckpointError:
        return None  # the directory holds no complete checkpoint: a fresh start


def load_resumed(strategy, plan, log) -> tuple[int, list[float], float]:
    """Load plan.resume_from into the strategy (every rank). Returns the job's losses before it
    (first step, losses: a checkpoint carries them in meta.json) and the seconds the load took."""

    if plan.resume_from is None:
        if plan.resume_auto:
            log.info("train.resume=auto: no complete checkpoint in %s: starting at step 0",
                     checkpoint_root(plan.checkpoint_dir, plan.run_dir))
        return 0, [], 0.0
    start = time.perf_counter()
    model_state, optim_state = load_state(Path(plan.resume_from))  # gathered or sharded
    strategy.load_full_state(model_state, optim_state)
    del model_state, optim_state
    seconds = time.perf_counter() - start
    meta = read_meta(Path(plan.resume_from))
    history = meta.get("losses", {"first_step": plan.start_step, "values": []})
    log.info("%sresumed from %s: continuing at step %d (loaded in %.2f s)",
             "train.resume=auto: " if plan.resume_auto else "", plan.resume_from, plan.start_step, seconds)
    return int(history["first_step"]), list(history["values"]), seconds


def losses_meta(first_step: int, losses: list[float]) -> dict:
    """What a checkpoint records of the losses before it, so a resumed job reports them all."""
    return {"losses": {"first_step": first_step, "values": list(losses)}}


def job_fields(plan, history_first: int, history: list[float], losses: list[float], journal, state: dict,
               log) -> dict:
    """summary.json's fields about the whole job: the final parameters' hash (rank 0 holds the full
    `state`), the failures it recovered from, and, for a `resume=auto` job, the losses of every step
    it ran, those of earlier attempts included (`attempt_first_step`: where this attempt began)."""
    from parallel.reliability.params_hash import params_sha256
    from parallel.reliability.recovery import recovery_block, recovery_line

    fields = {"final_params_sha256": params_sha256(state), "recovery": recovery_block(journal)}
    for entry in fields["recovery"]:
        log.info(recovery_line(entry))
    if plan.resume_auto:
        job_losses = [*history[:plan.start_step - history_first], *losses]
        fields.update(attempt=plan.attempt, attempt_first_step=plan.start_step, first_step=history_first,
                      losses=job_losses, steps=len(job_losses))
    return fields
