"""What every pipeline rank did when: the measured bubble beside the simulator's and the closed form.

Each rank records one span per action of the last step (wall-clock `time.time()`, so the ranks of
one machine share a clock). Rank 0 measures the bubble of one pipeline the same way the simulator
predicts it: the share of p × (step window) in which a rank ran neither a forward nor a backward.
The measured figure counts every such moment: posting and waiting for sends and receives, and on a
machine with fewer cores than ranks, the time a rank waited for a core; the simulator runs the
schedule alone, every forward and backward at this run's mean time, communication free. A
measured bubble far above the simulated one is that difference, not the schedule.

The colours are shared with the run's timeline of every rank (parallel/report/trace.py).
"""

from __future__ import annotations

from parallel.pp.schedules import build_schedule
from parallel.pp.simulator import simulate, unit_costs

COMPUTE_KINDS = ("forward", "backward")
# "p2p": posting sends and receives; "wait": waiting for a receive to arrive (or, at the end of
# the step, for this rank's own sends to complete): the visible bubble.
COLORS = {"forward": "#4C72B0", "backward": "#55A868", "p2p": "#BBBBBB", "wait": "#DD8452"}


def measured_bubble(rank_spans: list[list[dict]]) -> float:
    start = min(s["start"] for spans in rank_spans for s in spans)
    end = max(s["end"] for spans in rank_spans for s in spans)
    busy = sum(s["end"] - s["start"] for spans in rank_spans for s in spans if s["kind"] in COMPUTE_KINDS)
    return 1.0 - busy / (len(rank_spans) * (end - start))


def simulated_bubble(rank_spans: list[list[dict]], schedule: str, stages: int, microbatches: int, virtual: int) -> dict:
    """The simulator's prediction with this run's own mean forward and backward times."""
    def mean(kind):
        times = [s["end"] - s["start"] for spans in rank_spans for s in spans if s["kind"] == kind]
        return sum(times) / len(times)

    forward, backward = mean("forward") * virtual, mean("backward") * virtual  # per rank's whole share
    result = simulate(build_schedule(schedule, stages, microbatches, virtual), microbatches, virtual,
                      cost=unit_costs(forward, backward))
    return {"bubble": result.bubble_fraction, "peak_activations": result.peak_activations,
            "forward_s": forward / virtual, "backward_s": backward / virtual}


def pipeline_report(rank_spans: list[list[dict]], schedule: str, stages: int, microbatches: int, virtual: int) -> dict:
    """The bubble figures for summary.json: measured on this run's spans, simulated with its mean
    forward and backward times, and the closed form (p-1)/(v·m+p-1). The run's trace.json and
    timeline.png, of every rank, are drawn by parallel/report/trace.py."""
    bubble = measured_bubble(rank_spans)
    sim = simulated_bubble(rank_spans, schedule, stages, microbatches, virtual)
    closed = (stages - 1) / (virtual * microbatches + stages - 1)
    return {
        "schedule": schedule, "stages": stages, "microbatches": microbatches, "virtual_stages": virtual,
        "bubble_measured": bubble, "bubble_simulated": sim["bubble"], "bubble_closed_form": closed,
        "peak_activations_simulated": sim["peak_activations"],
        "mean_forward_s": sim["forward_s"], "mean_backward_s": sim["backward_s"],
    }
