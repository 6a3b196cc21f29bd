"""What a failure cost: the recovery journal and summary.json's `recovery` block.

Every process of a job that may be restarted writes a few stamps to one small file in the run
directory, `recovery.jsonl` (appended, fsynced, one JSON line each), so that the attempt after a
failure can tell what happened to the one before:

    fault      the failing rank, just before it dies (faults.py): time, rank, step, attempt, mode
    detected   each survivor, as the failure reaches it (train()'s except path, else launch/train.py's)
    exited     each survivor, just before it leaves (best effort: torchrun may stop it first)
    recovered  rank 0 of the next attempt, once it is back at the step where the fault fired: the
               entry below, one per failure; the summary lists them all

An entry splits the failure's cost in seconds, each part measured on its own:

    detection   first survivor's `detected` - the fault's time
    teardown    last survivor's `exited` - the first `detected`
    restart     the new attempt's process start (the kernel's) - the last `exited`: torchrun's
                agent notices, stops the group, meets again in its rendezvous, starts the workers
                (where no survivor left a stamp, torchrun stopped them first: detection and
                teardown are 0 and restart counts from the fault; `survivors_detected` says so)
    rendezvous  process start - process groups ready (interpreter, imports, init_process_group)
    setup       process groups ready - the strategy built (its own clock)
    load        checkpoint read and loaded into the strategy (its own clock)
    recompute   the steps from the checkpoint's to the fault's, which had run before (their step times)

and sets them against the downtime, measured by its two ends alone: from the fault's time to the
moment the new attempt starts the step before which the fault fired. `unexplained_s` is what the
parts leave out (the loop's bookkeeping between steps, logging): the parts are not defined as the
downtime's pieces, so their sum can miss it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

JOURNAL = "recovery.jsonl"
PARTS = ("detection_s", "teardown_s", "restart_s", "rendezvous_s", "setup_s", "load_s", "recompute_s")


class Journal:
    """Appends stamped records to <run dir>/recovery.jsonl; each line is on disk before it returns."""

    def __init__(self, run_dir: Path | str, rank: int, attempt: int):
        self.path, self.rank, self.attempt = Path(run_dir) / JOURNAL, rank, attempt

    def append(self, event: str, **fields) -> None:
        record = {"event": event, "time": fields.pop("time", time.time()), "rank": self.rank,
                  "attempt": self.attempt, **fields}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def fault(self, step: int, mode: str) -> None:
        self.append("fault", step=step, mode=mode)

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def process_start_time() -> float:
    """This process's start, from the kernel (Linux /proc), as a unix time; now where unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


@dataclass
class Attempt:
    """This attempt's own stamps, and the previous attempt's fault it has yet to make good."""

    journal: Journal | None
    process_start: float
    groups_ready: float
    setup_s: float = 0.0
    load_s: float = 0.0
    resumed_at: int = 0  # the first step this attempt runs
    pending: dict | None = None  # the fault that ended the previous attempt, until this one reaches its step
    stopped: list[dict] = field(default_factory=list)  # the previous attempt's survivors' records

    @classmethod
    def start(cls, journal: Journal | None, groups_ready: float) -> Attempt:
        """`groups_ready`: when this attempt's process groups came up; reads what the previous attempt left."""
        attempt = cls(journal, process_start_time(), groups_ready)
        if journal is not None and journal.attempt > 0:
            before = [r for r in journal.records() if r["attempt"] == journal.attempt - 1]
            faults = [r for r in before if r["event"] == "fault"]
            attempt.pending = faults[0] if faults else None
            attempt.stopped = [r for r in before if r["event"] in ("detected", "exited")]
        return attempt

    def reached(self, step: int, step_times: list[float]) -> dict | None:
        """At the top of `step`: if it is the pending fault's, its entry (journaled by rank 0)."""
        if self.pending is None or step != self.pending["step"]:
            return None
        entry = recovery_entry(self.pending, self.stopped, self, time.time(), step_times)
        self.pending = None
        if self.journal is not None and self.journal.rank == 0:
            self.journal.append("recovered", **entry)
        return entry


def recovery_entry(fault: dict, stopped: list[dict], attempt: Attempt, recovered: float,
                   step_times: list[float]) -> dict:
    """One failure's parts and downtime (see the module's docstring); `step_times` are this
    attempt's, from its first step, which were all recomputed when the entry is made."""
    detected = [r["time"] for r in stopped if r["event"] == "detected"]
    exited = [r["time"] for r in stopped if r["event"] == "exited"]
    first_seen = min(detected) if detected else None
    last_exit = max(exited) if exited and detected else first_seen
    parts = {
        "detection_s": first_seen - fault["time"] if first_seen is not None else 0.0,
        "teardown_s": last_exit - first_seen if first_seen is not None else 0.0,
        "restart_s": attempt.process_start - (last_exit if last_exit is not None else fault["time"]),
        "rendezvous_s": attempt.groups_ready - attempt.process_start,
        "setup_s": attempt.setup_s,
        "load_s": attempt.load_s,
        "recompute_s": float(sum(step_times)),
    }
    downtime = recovered - fault["time"]
    explained = sum(parts.values())
    return {
        "fault_time": fault["time"], "fault_rank": fault["rank"], "fault_step": fault["step"],
        "fault_mode": fault["mode"], "failed_attempt": fault["attempt"],
        "resumed_from_step": attempt.resumed_at, "steps_recomputed": fault["step"] - attempt.resumed_at,
        "survivors_detected": len(detected), "survivors_exited": len(exited),
        **parts, "downtime_s": downtime, "explained_s": explained, "unexplained_s": downtime - explained,
    }


def note_stopped(run_dir, rank: int, attempt: int) -> float:
    """A survivor's `detected` record, first thing where the failure is caught: torchrun may stop
    this rank any moment now. Returns its time."""
    now = time.time()
    Journal(run_dir, rank, attempt).append("detected", time=now)
    return now


def recovery_block(journal: Journal | None) -> list[dict]:
    """summary.json's `recovery`: one entry per failure the job recovered from, oldest first."""
    if journal is None:
        return []
    return [{k: v for k, v in r.items() if k not in ("event", "time", "rank")} | {"recovered_attempt": r["attempt"]}
            for r in journal.records() if r["event"] == "recovered"]


def recovery_line(entry: dict) -> str:
    """The console's line for one failure."""
    parts = " + ".join(f"{k[:-2]} {entry[k]:.2f}" for k in PARTS)
    return (f"recovery: rank {entry['fault_rank']} failed ({entry['fault_mode']}) before step {entry['fault_step']}, "
            f"resumed from step {entry['resumed_from_step']}: {parts} = {entry['explained_s']:.2f} s of "
            f"{entry['downtime_s']:.2f} s down ({entry['unexplained_s']:+.2f} s unexplained)")
