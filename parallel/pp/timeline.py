"""What every pipeline rank did when: the measured bubble beside the simulator's and the closed form.

Each rank records one span per action of the last step, stamped by the step's clock: on the CPU
the wall clock (`time.time()`, so the ranks of one machine share it); on a GPU CUDA events on the
stream that runs the work, read as seconds from the step's origin event plus the origin's wall
time (parallel/dist/timing.py's StepClock), so that the bubble and the F, B and W times are the
device's, and ranks are placed side by side as well as their hosts' clocks agree at each step's
start. Rank 0 measures the bubble of one pipeline the same way the simulator
predicts it: the share of p × (step window) in which a rank computed nothing (no F, B or W).
The measured figure counts every such moment: posting and waiting for sends and receives, and on a
machine with fewer cores than ranks, the time a rank waited for a core; the simulator runs the
schedule alone, every F, B and W at this run's mean time, communication free. A measured bubble
far above the simulated one is that difference, not the schedule.

The colours are shared with the run's timeline of every rank (parallel/report/trace.py).
"""

from __future__ import annotations

from parallel.pp.schedules import (
    build_schedule,
    closed_form_bubble,
    closed_form_note,
    schedule_placement,
    splits_backward,
)
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
    """This run's mean F, B and W times per rank's whole share (a chunk's times v), as the closed
    forms (schedules.py) take them; W is 0 where the schedule does not split the backward (B is then all of it)."""
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


def pipeline_report(rank_spans: list[list[dict]], schedule: str, stages: int, microbatches: int, virtual: int) -> dict:
    """The bubble figures for summary.json: measured on this run's spans, simulated with its mean F,
    B and W times, and the schedule's closed form with the same times (None where none is claimed,
    and `bubble_closed_form_note` then says "no closed form" and why: a schedule with no formula,
    ZB-V below m = 2p-1). The run's trace.json and timeline.png, of every rank, are drawn by
    parallel/report/trace.py."""
    bubble = measured_bubble(rank_spans)
    sim = simulated_bubble(rank_spans, schedule, stages, microbatches, virtual)
    closed = closed_form_bubble(schedule, stages, microbatches, virtual, *mean_times(rank_spans, virtual))
    return {
        "schedule": schedule, "stages": stages, "microbatches": microbatches, "virtual_stages": virtual,
        "bubble_measured": bubble, "bubble_simulated": sim["bubble"],
        "bubble_closed_form": None if closed is None else float(closed),
        "bubble_closed_form_note": closed_form_note(schedule, stages, microbatches, virtual),
        "splits_backward": sim["splits_backward"], "peak_activations_simulated": sim["peak_activations"],
        "mean_forward_s": sim["forward_s"], "mean_backward_s": sim["backward_s"], "mean_weight_s": sim["weight_s"],
    }
