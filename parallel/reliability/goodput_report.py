"""Goodput, measured: the time of the steps that count toward the final model over the job's wall
time, from the job's log (parallel/reliability/job_log.py), and the model's prediction beside it.

The steps that count: a step run twice (once before a failure, again after the restart resumed
from an older checkpoint) counts once, its last run; the earlier runs are recomputed work. The
wall time runs from the first attempt's start to the last step's end (its saves included), and
splits into parts that add up to it exactly:

    setup_s            every attempt's start to its first step (imports, groups, model, load)
    useful_steps_s     the steps that count
    saves_s            checkpoint saves (blocking), in every attempt
    recomputed_steps_s steps whose work a failure threw away (run again later)
    in_flight_s        from a failed attempt's last finished step or save to its fault
    restart_s          from a fault to the next attempt's start (detection, teardown, restart)
    finish_s           from the last step or save to the end of the loop (closing the strategy)
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict

from parallel.reliability.goodput import GoodputInputs, predict
from parallel.reliability.job_log import read_job_log
from parallel.reliability.recovery import Journal

log = logging.getLogger("parallel")

PARTS = ("setup_s", "useful_steps_s", "saves_s", "recomputed_steps_s", "in_flight_s", "restart_s", "finish_s")


def _span(event: dict) -> float:
    return event["end"] - event["start"]


def _by_attempt(events: list[dict]) -> dict[int, dict]:
    """Each attempt's start, set-up end, marks (steps and saves, in order), fault and end."""
    attempts: dict[int, dict] = defaultdict(lambda: {"start": None, "setup_end": None, "marks": [], "fault": None,
                                                     "end": None})
    for e in events:
        a = attempts[e["attempt"]]
        if e["event"] == "attempt":
            a["start"] = e["start"]
        elif e["event"] == "setup":
            a["setup_end"] = e["end"]
        elif e["event"] in ("step", "save"):
            a["marks"].append(e)
        elif e["event"] == "fault":
            a["fault"] = e
            a["start"] = a["start"] if a["start"] is not None else e.get("attempt_start")
        elif e["event"] == "end":
            a["end"] = e["end"]
    return dict(sorted(attempts.items()))


def _last_mark(a: dict) -> float:
    """Where a failed attempt's accounted time stops: its last step or save, else its set-up."""
    if a["marks"]:
        return a["marks"][-1]["end"]
    return a["setup_end"] if a["setup_end"] is not None else a["start"]


def measure(events: list[dict]) -> dict:
    """The measured goodput and its parts, from one job's events (the last attempt must have ended)."""
    attempts = _by_attempt(events)
    numbers = list(attempts)
    final = attempts[numbers[-1]]
    if final["end"] is None or any(a["start"] is None for a in attempts.values()):
        raise ValueError("the job log has no end, or an attempt without a start: the job has not finished")
    last_run = {}  # step -> its last run: the one the final model descends from
    for n in numbers:
        for m in attempts[n]["marks"]:
            if m["event"] == "step":
                last_run[m["step"]] = m
    parts = dict.fromkeys(PARTS, 0.0)
    failures = []
    for i, n in enumerate(numbers):
        a = attempts[n]
        parts["setup_s"] += (a["setup_end"] if a["setup_end"] is not None else _last_mark(a)) - a["start"]
        for m in a["marks"]:
            kind = "saves_s" if m["event"] == "save" else (
                "useful_steps_s" if last_run[m["step"]] is m else "recomputed_steps_s")
            parts[kind] += _span(m)
        if a is final:
            parts["finish_s"] += a["end"] - _last_mark(a)
            continue
        nxt = attempts[numbers[i + 1]]
        fault_at = a["fault"]["at"] if a["fault"] else _last_mark(a)  # unknown: all of it counted as restart
        parts["in_flight_s"] += fault_at - _last_mark(a)
        parts["restart_s"] += nxt["start"] - fault_at
        failures.append(_failure(a, nxt, n, fault_at, attempts[numbers[0]]["start"]))
    wall = final["end"] - attempts[numbers[0]]["start"]
    useful_steps = sorted(last_run)
    return {
        "measured": parts["useful_steps_s"] / wall if wall > 0 else None,
        "wall_s": wall, "useful_s": parts["useful_steps_s"], "parts_s": parts, "parts_sum_s": sum(parts.values()),
        "attempts": len(numbers), "failures": failures,
        "first_setup_s": _first_setup(attempts[numbers[0]]),
        "useful_steps": len(useful_steps),
        "recomputed_steps": sum(1 for n in numbers for m in attempts[n]["marks"]
                                if m["event"] == "step" and last_run[m["step"]] is not m),
        "step_spans_s": [_span(last_run[s]) for s in useful_steps],
        "save_spans_s": [_span(m) for n in numbers for m in attempts[n]["marks"] if m["event"] == "save"],
    }


def _first_setup(a: dict) -> float:
    """The job's one-time start-up: its first attempt's set-up (all of it, if it never finished)."""
    return (a["setup_end"] if a["setup_end"] is not None else _last_mark(a)) - a["start"]


def _failure(a: dict, nxt: dict, attempt: int, fault_at: float, job_start: float) -> dict:
    """One failure: when (since the job began), who, and what the restart cost, measured."""
    fault = a["fault"] or {}
    steps = [m["step"] for m in a["marks"] if m["event"] == "step"]
    first_step = next((m for m in nxt["marks"] if m["event"] == "step"), None)
    return {
        "attempt": attempt, "kind": fault.get("kind", "unknown"), "rank": fault.get("rank"),
        "at_s": fault_at - job_start, "delay_s": fault.get("delay_s"),
        "last_step_done": steps[-1] if steps else None,
        "restart_s": nxt["start"] - fault_at,  # detection, teardown, restart, rendezvous up to the new processes
        "to_setup_done_s": (nxt["setup_end"] - fault_at) if nxt["setup_end"] is not None else None,
        "first_step_s": _span(first_step) if first_step else None,
    }


def restart_cost(failures: list[dict], step_s: float) -> float | None:
    """R: from the fault to the set-up done in the next attempt, plus its first step's excess over
    a normal step (warm-up: the first step after a start pays for lazy initialisation), mean over
    failures; None without a failure whose next attempt reached its first step."""
    costs = [f["to_setup_done_s"] + max(0.0, f["first_step_s"] - step_s) for f in failures
             if f["to_setup_done_s"] is not None and f["first_step_s"] is not None]
    return statistics.fmean(costs) if costs else None


def goodput_block(events: list[dict], steps_per_checkpoint: int, mtbf_s: float | None) -> dict:
    """summary.json's `goodput`: measured, and the model's prediction from this job's own
    measurements (t, delta, R) and the configured M; `sources` says where each input came from."""
    measured = measure(events)
    step_s = statistics.median(measured["step_spans_s"]) if measured["step_spans_s"] else None
    save_s = statistics.median(measured["save_spans_s"]) if measured["save_spans_s"] else None
    restart = restart_cost(measured["failures"], step_s or 0.0)
    block = {**measured, "predicted": None, "sources": {
        "step_s": "median span of this job's useful steps (job_log.jsonl)",
        "save_s": "median span of this job's checkpoint saves",
        "restart_s": "mean over this job's failures: fault to set-up done, plus the first step's excess",
        "mtbf_s": "train.chaos.mtbf_s"}}
    if None not in (step_s, save_s, restart, mtbf_s) and steps_per_checkpoint:
        block["predicted"] = predict(GoodputInputs(step_s, steps_per_checkpoint, save_s, restart, mtbf_s))
    return block


def goodput_line(block: dict) -> str:
    """The console's one line."""
    parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in block["parts_s"].items())
    line = (f"goodput {block['measured']:.3f}: {block['useful_s']:.1f} s of useful steps in {block['wall_s']:.1f} s "
            f"of wall time over {block['attempts']} attempt(s), {len(block['failures'])} failure(s) ({parts})")
    predicted = block["predicted"]
    if predicted:
        line += (f"; model {predicted['first_order']:.3f} first order, {predicted['daly']:.3f} Daly "
                 f"(best interval {predicted['best_interval_s']:.1f} s)")
    return line


def journal_faults(events: list[dict], records: list[dict]) -> list[dict]:
    """The recovery journal's faults (recovery.py: `train.fail_mode` ones as well as chaos's) as job
    log events, for the attempts whose fault the job log lacks; records older than the job's
    first attempt are another job's."""
    starts = [e["start"] for e in events if e["event"] == "attempt"]
    have = {e["attempt"] for e in events if e["event"] == "fault"}
    return [{"attempt": r["attempt"], "event": "fault", "kind": r.get("mode"), "rank": r["rank"], "at": r["time"],
             "step": r.get("step")} for r in records
            if r["event"] == "fault" and r["attempt"] not in have and starts and r["time"] >= min(starts)]


def add_goodput(summary: dict, run_dir, plan) -> None:
    """summary.json's `goodput` block from the run directory's job log and recovery journal, and
    its console line."""
    events = read_job_log(run_dir)
    events += journal_faults(events, Journal(run_dir, 0, 0).records())
    try:
        block = goodput_block(events, plan.checkpoint_every, plan.chaos_mtbf_s)
    except ValueError as e:  # a log that does not cover the job (written by another version, or cut)
        summary["goodput"] = {"measured": None, "note": str(e)}
        return
    summary["goodput"] = block
    log.info(goodput_line(block))
