"""What every pipeline rank did when: the measured bubble, trace.json and timeline.png.

Each rank records one span per action of the last step (wall-clock `time.time()`, so the ranks of
one machine share a clock). Rank 0 merges them into a Chrome trace (open it in Perfetto or
chrome://tracing) and a Gantt chart, and measures the bubble the same way the simulator predicts
it: the share of p × (step window) in which a rank computed nothing (no F, B or W).
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel.pp.bubble import closed_form_bubble
from parallel.pp.schedules import build_schedule, schedule_placement, splits_backward
from parallel.pp.simulator import simulate, split_costs

# "backward" is B: the whole backward, or in a zero-bubble schedule only the input gradient, whose
# weight gradients are then "weight", W.
COMPUTE_KINDS = ("forward", "backward", "weight")
# "p2p": posting sends and receives; "wait": waiting for a receive to arrive (or, at the end of
# the step, for this rank's own sends to complete): the visible bubble.
COLORS = {"forward": "#4C72B0", "backward": "#55A868", "weight": "#8172B3", "p2p": "#BBBBBB", "wait": "#DD8452"}


def measured_bubble(rank_spans: list[list[dict]]) -> float:
    start = min(s["start"] for spans in rank_spans for s in spans)
    end = max(s["end"] for spans in rank_spans for s in spans)
    busy = sum(s["end"] - s["start"] for spans in rank_spans for s in spans if s["kind"] in COMPUTE_KINDS)
    return 1.0 - busy / (len(rank_spans) * (end - start))


def mean_times(rank_spans: list[list[dict]], virtual: int) -> tuple[float, float, float]:
    """This run's mean F, B and W times per rank's whole share (a chunk's times v), as bubble.py
    takes them; W is 0 where the schedule does not split the backward (B is then all of it)."""
    def mean(kind):
        times = [s["end"] - s["start"] for spans in rank_spans for s in spans if s["kind"] == kind]
        return sum(times) / len(times) * virtual if times else 0.0

    return mean("forward"), mean("backward"), mean("weight")


def simulated_bubble(rank_spans: list[list[dict]], schedule: str, stages: int, microbatches: int, virtual: int) -> dict:
    """The simulator's prediction, on the schedule's own placement, with this run's mean F, B and W times."""
    forward, input_grad, weight_grad = mean_times(rank_spans, virtual)
    plans = build_schedule(schedule, stages, microbatches, virtual)
    result = simulate(plans, microbatches, virtual, split_costs(forward, input_grad, weight_grad),
                      schedule_placement(schedule, stages, virtual))
    return {"bubble": result.bubble_fraction, "peak_activations": result.peak_activations,
            "forward_s": forward / virtual, "backward_s": input_grad / virtual, "weight_s": weight_grad / virtual,
            "splits_backward": splits_backward(plans)}


def chrome_trace(rank_spans: list[list[dict]]) -> dict:
    origin = min(s["start"] for spans in rank_spans for s in spans)
    events = []
    for rank, spans in enumerate(rank_spans):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"pp rank {rank}"}})
        for s in spans:
            events.append({
                "name": s["name"], "cat": s["kind"], "ph": "X", "pid": 0, "tid": rank,
                "ts": (s["start"] - origin) * 1e6, "dur": max(s["end"] - s["start"], 0.0) * 1e6,
                "args": {"microbatch": s["mb"], "chunk": s["chunk"]},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_timeline(rank_spans: list[list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(s["start"] for spans in rank_spans for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rank_spans) + 1.5))
    for rank, spans in enumerate(rank_spans):
        for s in spans:
            left, width = (s["start"] - origin) * 1e3, (s["end"] - s["start"]) * 1e3
            ax.barh(rank, width, left=left, height=0.8, color=COLORS[s["kind"]], edgecolor="white", linewidth=0.3)
            if s["kind"] in COMPUTE_KINDS and width > 0:
                ax.text(left + width / 2, rank, s["name"], ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rank_spans)), [f"rank {r}" for r in range(len(rank_spans))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (orange: waiting for a neighbour, the bubble; purple: W, weight gradients)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_pipeline_report(run_dir: Path, rank_spans: list[list[dict]], schedule: str, stages: int, microbatches: int,
                          virtual: int) -> dict:
    """trace.json, timeline.png and the bubble figures for summary.json."""
    (run_dir / "trace.json").write_text(json.dumps(chrome_trace(rank_spans)))
    bubble = measured_bubble(rank_spans)
    sim = simulated_bubble(rank_spans, schedule, stages, microbatches, virtual)
    # bubble.py's form with the same times (None where none is claimed: ZB-V below m = 2p-1).
    closed = closed_form_bubble(schedule, stages, microbatches, virtual, *mean_times(rank_spans, virtual))
    closed = None if closed is None else float(closed)
    draw_timeline(rank_spans, run_dir / "timeline.png",
                  f"{schedule}: p={stages} m={microbatches} v={virtual} | bubble measured {bubble:.1%}, "
                  f"simulated {sim['bubble']:.1%}, closed form " + ("none" if closed is None else f"{closed:.1%}"))
    return {
        "schedule": schedule, "stages": stages, "microbatches": microbatches, "virtual_stages": virtual,
        "bubble_measured": bubble, "bubble_simulated": sim["bubble"], "bubble_closed_form": closed,
        "splits_backward": sim["splits_backward"], "peak_activations_simulated": sim["peak_activations"],
        "mean_forward_s": sim["forward_s"], "mean_backward_s": sim["backward_s"], "mean_weight_s": sim["weight_s"],
        "trace": "trace.json", "timeline": "timeline.png",
    }
