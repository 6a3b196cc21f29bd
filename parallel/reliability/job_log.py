"""The job's timeline across restarts: one line per event in `<run dir>/job_log.jsonl`.

A job under `torchrun --max-restarts` is several attempts, each a fresh set of processes, so
nothing in memory survives a failure: what the goodput report needs (parallel/reliability/
goodput_report.py) is appended to a file in the run directory as it happens, by rank 0, and by
the rank that a chaos fault kills (its last act). Every line carries torchrun's run id (one per
job, the same in every attempt) and the attempt number, so a run directory reused by another job
is read without mixing the two. Wall-clock (unix) times, comparable across processes:

    attempt  the attempt's processes started (rank 0's process creation time)
    setup    set-up done (groups, model, checkpoint load): the first step starts
    step     step k ran from `start` to `end` (the whole loop iteration, bookkeeping included)
    save     the checkpoint after `step` steps took `start` to `end`
    fault    a rank died on purpose (chaos): when, which rank, how long after its attempt began
    end      the last step and its saves are done; the report is next

Consecutive marks share their boundary (each span starts where the previous one ended), so an
attempt's time splits with nothing left over into set-up, steps, saves and, for a failed one,
the time from its last mark to the fault.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from parallel.reliability.recovery import Journal, process_start_time
from parallel.reliability.resume import job_identity

FILE_NAME = "job_log.jsonl"


def job_id() -> str:
    """One id per job, the same in every attempt: the one that names a resume=auto job's run
    directory (resume.py: Slurm's job id, else torchrun's run id); "local" outside both."""
    return job_identity() or "local"


class JobLog:
    """Appends this job's events to the run directory's log; rank 0 writes the marks."""

    def __init__(self, run_dir: Path | None, rank: int, next_step: int = 0, attempt: int = 0):
        self.path = None
        self.rank, self.attempt = rank, attempt  # the plan's attempt number (resume.py: attempt_number)
        self.next_step = next_step  # the step this rank runs next: where a fault now would strike
        self.writes_marks = False
        self.last_mark = process_start_time()  # the set-up's span starts with the process
        if run_dir is not None:
            self.bind(run_dir)

    def bind(self, run_dir: Path) -> None:
        """The run directory is known: from here events are written, this attempt's start first."""
        if self.path == Path(run_dir) / FILE_NAME:
            return
        self.path = Path(run_dir) / FILE_NAME
        self.writes_marks = self.rank == 0
        if self.writes_marks:
            self._write("attempt", start=process_start_time())

    def _write(self, event: str, **fields) -> None:
        if self.path is None:
            return
        line = json.dumps({"job": job_id(), "attempt": self.attempt, "event": event, **fields})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one short append per line: lines of two processes never interleave
            f.write(line + "\n")

    def _mark(self, event: str, **fields) -> None:
        now = time.time()
        if self.writes_marks:
            self._write(event, start=self.last_mark, end=now, **fields)
        self.last_mark = now

    def setup_done(self) -> None:
        self._mark("setup")

    def step_done(self, step: int) -> None:
        self._mark("step", step=step)
        self.next_step = step + 1

    def save_done(self, steps_done: int) -> None:
        self._mark("save", step=steps_done)

    def job_done(self) -> None:
        self._mark("end")

    def fault(self, **fields) -> None:
        """Any rank: the one that is about to die says so, here and in the recovery journal
        (recovery.py: the next attempt measures what the failure cost from it), before the step it
        strikes. If it dies before the run directory is known, only its stderr line tells."""
        self._write("fault", step=self.next_step, **fields)
        if self.path is not None:
            Journal(self.path.parent, self.rank, self.attempt).fault(self.next_step, fields.get("kind", "chaos"))


def read_job_log(run_dir: Path, job: str | None = None) -> list[dict]:
    """This job's events in the order written (a torn last line of a killed writer is skipped)."""
    path = Path(run_dir) / FILE_NAME
    if not path.exists():
        return []
    job = job_id() if job is None else job
    events = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("job") == job:
            events.append(event)
    return events
