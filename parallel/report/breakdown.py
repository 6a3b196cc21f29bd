"""Where each step's time goes, per rank: compute, exposed communication, bubble, optimizer, other.

A rank's step is tiled by the phases its strategy marks (report/phases.py), and the communication
log keeps the step's calls as spans (dist/commlog.py). Every span during which the rank was blocked
(a blocking call, or the wait for an async one) is taken out of the phase it fell in, and counted
on its own:

    compute       forward, backward (a split backward's W: weight), recompute phases, less the
                  communication inside them
    exposed_comm  blocked in communication, by "op group": what computation did not hide
    bubble        blocked in pipeline point-to-point (send or recv over "pp"): a stage waiting for
                  its neighbour's activations or gradients (or for its own sends to drain)
    optimizer     the optimizer phase, less communication inside it (ZeRO's all-gather is comm)
    other         zeroing, sync bookkeeping, posting p2p, the finite check's own work, less comm

The phases are stamped by the clock that times the step (dist/timing.py), from its start to its
end, so per rank and step the five add up to the step's measured time. A span is placed by its
start; on one thread a call lies inside the phase that made it, so no part comes out negative
unless a call were counted twice (the tests check both).

For the run (`summarize_breakdown`, summary.json): one step, the timed step whose slowest-rank
time is the median (the lower of the two middle ones for an even count), so that the breakdown
adds up to a step time the summary lists. Per rank its five at that step, `other` also holding
the time the rank waited for the slowest one after finishing its own step (a step lasts as long as
its slowest rank); `time_breakdown_s` is their mean over ranks. They sum to that step's time.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections import defaultdict

from parallel.core.phases import CATEGORY_OF_PHASE

CATEGORIES = ("compute", "exposed_comm", "bubble", "optimizer", "other")
COMPUTE_PHASES = ("forward", "backward", "weight", "recompute")  # always listed, 0 where a step had none
WAITING_FOR_SLOWEST = "waiting for the slowest rank"


def is_bubble(span: dict) -> bool:
    return span["group"] == "pp" and span["op"] in ("send", "recv")


def rank_step_breakdown(phases: list[dict], spans: list[dict], step_s: float) -> dict | None:
    """One rank's step: {step_s, phases_s, compute: {phase: s}, exposed_comm: {"op group": s},
    bubble, optimizer, other: {phase: s}}; None without phases (no clock)."""
    if not phases:
        return None
    starts = [p["start"] for p in phases]
    end = phases[-1]["end"]
    net: dict[str, float] = defaultdict(float)
    for p in phases:
        net[p["phase"]] += p["end"] - p["start"]
    exposed: dict[str, float] = defaultdict(float)
    bubble = 0.0
    for s in spans:
        if not s["blocked"] or not starts[0] <= s["start"] < end:
            continue  # a post (the rank went on), or outside the step (the loss reduced for the log)
        seconds = min(s["end"], end) - s["start"]
        net[phases[bisect_right(starts, s["start"]) - 1]["phase"]] -= seconds
        if is_bubble(s):
            bubble += seconds
        else:
            exposed[f"{s['op']} {s['group']}"] += seconds
    by_category: dict[str, dict[str, float]] = defaultdict(dict)
    for phase, seconds in net.items():
        by_category[CATEGORY_OF_PHASE[phase]][phase] = seconds
    compute = {phase: 0.0 for phase in COMPUTE_PHASES} | by_category["compute"]
    return {"step_s": step_s, "phases_s": end - starts[0], "compute": compute, "exposed_comm": dict(exposed),
            "bubble": bubble, "optimizer": sum(by_category["optimizer"].values()), "other": by_category["other"]}


def five(b: dict) -> dict[str, float]:
    """The five categories of a rank's step breakdown, in seconds."""
    return {"compute": sum(b["compute"].values()), "exposed_comm": sum(b["exposed_comm"].values()),
            "bubble": b["bubble"], "optimizer": b["optimizer"], "other": sum(b["other"].values())}


def median_step(step_times: list[float], timed_from: int) -> int:
    """The index of the timed step whose time is the median (the lower middle for an even count)."""
    timed = sorted(range(timed_from, len(step_times)), key=lambda i: step_times[i])
    return timed[(len(timed) - 1) // 2]


def _mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d}, key=lambda k: -sum(d.get(k, 0.0) for d in dicts))
    return {k: statistics.fmean(d.get(k, 0.0) for d in dicts) for k in keys}


def summarize_breakdown(rank_steps: list[list[dict | None]], step_times: list[float], timed_from: int,
                        first_step: int, notes: list[str]) -> dict:
    """summary.json's `time_breakdown_s`, `time_breakdown` (the detail) and `time_breakdown_by_rank`;
    `rank_steps[r][i]`: rank r's breakdown of step i; `step_times`: the slowest rank's, per step."""
    index = median_step(step_times, timed_from)
    slowest = step_times[index]
    if any(steps[index] is None for steps in rank_steps):
        return {"time_breakdown_s": None, "time_breakdown_by_rank": None,
                "time_breakdown": {"step": first_step + index, "notes": notes}}
    by_rank, details = [], []
    for rank, steps in enumerate(rank_steps):
        b = steps[index]
        other = {**b["other"], WAITING_FOR_SLOWEST: max(0.0, slowest - b["step_s"])}
        b = {**b, "other": other}
        details.append(b)
        by_rank.append({"rank": rank, **five(b), "step_s": b["step_s"]})
    mean = {c: statistics.fmean(r[c] for r in by_rank) for c in CATEGORIES}
    return {
        "time_breakdown_s": mean,
        "time_breakdown": {
            "step": first_step + index,
            "step_time_s": slowest,
            "sum_s": sum(mean.values()),
            "compute_s": _mean_of([d["compute"] for d in details]),
            "exposed_comm_s": _mean_of([d["exposed_comm"] for d in details]),
            "bubble_s": mean["bubble"],
            "optimizer_s": mean["optimizer"],
            "other_s": _mean_of([d["other"] for d in details]),
            "definition": "the timed step whose slowest-rank time is the median (lower middle for an even count); "
                          "per rank: its phases less the communication it was blocked in, plus in other the wait "
                          "for the slowest rank; mean over ranks (parallel/report/breakdown.py)",
            "notes": notes,
        },
        "time_breakdown_by_rank": by_rank,
    }


def breakdown_notes(strategy_notes: list[str | None], comm_timed: bool,
                    rank_steps: list[list[dict | None]]) -> list[str]:
    """What the breakdown of this run cannot split, in words (for the summary and the report)."""
    notes = sorted({n for n in strategy_notes if n})
    if not comm_timed:
        notes.append("comm.log or comm.time is off: no call was timed, so communication is counted inside the phase "
                     "that made it (compute, optimizer, other)")
    last = [steps[-1] for steps in rank_steps if steps and steps[-1] is not None]
    if last and all(set(b["other"]) == {"unmarked"} and not any(b["compute"].values()) for b in last):
        notes.append("this strategy's train_step marks no phases (report/phases.py): all of its step but the "
                     "communication is 'other'")
    return notes
