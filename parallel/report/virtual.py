"""summary.json's `virtual` block: the run's step as it would take with a device per rank.

Rank 0 saves every rank's events (parallel/replay/events.py: events/rank<r>.json), replays the
timed steps on the run's link model (parallel/replay/virtual.py) and writes, beside the wall
clock's trace.json and timeline.png, the replayed median step on the same tracks:
trace_virtual.json and (where run.timeline is on) timeline_virtual.png.

On the CPU a rank's device is its cores, one per intra-op thread (parallel/replay/device.py): its
peak (for the virtual MFU) is the machine's measured peak over its usable cores, times the rank's.
A replay that cannot be made (a run without a clock, an op a member never posted) leaves
{"error": why} in the block, and the run goes on.

The virtual clock models CPU ranks: a rank's compute is its threads' CPU (or, with several, wall)
time, its links this machine's gloo loopback, probed after the steps (parallel/replay/probe.py). A
run on GPUs has neither: its ranks' CPU time is kernel launches, its links NCCL's, and its wall
clock already times a device per rank (CUDA events). So under NCCL, or on a CUDA device, the run
makes no probe (whose CPU tensors an NCCL group would refuse) and its block says why:
{"skipped": NOT_REPLAYED}. The cluster what-ifs of a CPU run (`launch.replay <run> cluster=...`)
are the virtual clock's answer to "on GPUs".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from parallel.replay import events as saved
from parallel.replay.device import cores_per_rank
from parallel.replay.virtual import replay_run
from parallel.report.mfu import usable_cores
from parallel.report.trace import chrome_trace, draw_timeline, rank_label, timeline_title

log = logging.getLogger("parallel")
TRACE, TIMELINE = "trace_virtual.json", "timeline_virtual.png"
NOT_REPLAYED = ("not replayed: the virtual clock models CPU ranks (compute in thread CPU time, links probed on "
                "this machine's gloo loopback); on a GPU the wall clock, timed with CUDA events, is a device per rank")


def replayable(device_type: str, backend: str | None) -> bool:
    """Whether the virtual clock applies to a run: CPU ranks on gloo, or one CPU process."""
    return device_type == "cpu" and backend in (None, "gloo")


def peak_per_device(summary: dict, events: list[dict]) -> float:
    """One device's peak: a GPU's own; on the CPU its cores' share of the machine's."""
    peak = summary["mfu"]["peak_flops"]
    return peak if summary["device"] == "cuda" else peak / usable_cores() * cores_per_rank(events)


def write_virtual(run_dir: Path, events: list[dict], summary: dict, links, draw: bool, *, cores: float | None = None,
                  compute_scale: float = 1.0, what_if: str | None = None, peak: float | None = None,
                  comm_cpu: bool | None = None) -> dict:
    """Replay `events` on `links`; the `virtual` block, with trace_virtual.json (and the timeline) in run_dir.
    `peak`: one device's peak FLOP/s (None: one core's, or the run's GPU's); `comm_cpu`: charge the
    communication's CPU to the ranks' cores (None: unless a cluster what-if or a GPU run, whose
    host threads take nothing of the device's compute)."""
    if comm_cpu is None and summary.get("device") == "cuda":
        comm_cpu = False
    block, traces = replay_run(events, links, tokens_per_step=summary["tokens_per_step"],
                               flops_per_token=summary["mfu"]["flops_per_token"],
                               peak_per_device=peak or peak_per_device(summary, events),
                               cores=cores, compute_scale=compute_scale, what_if=what_if, comm_cpu=comm_cpu,
                               period=int((summary.get("expected_comm") or {}).get("period_steps", 1)))
    labels = [rank_label(e["rank"], e.get("coords") or {}, summary["parallel"]) for e in events]
    (Path(run_dir) / TRACE).write_text(json.dumps(chrome_trace(traces, labels)))
    if draw:
        title = (f"{timeline_title(summary, block['step']).splitlines()[0]} | VIRTUAL: a device per rank, "
                 f"{block['link_model']['name']}{' | WHAT-IF: ' + what_if if what_if else ''}")
        draw_timeline(traces, labels, Path(run_dir) / TIMELINE, title)
    block["trace"] = {"trace": TRACE, "timeline": TIMELINE if draw else None}
    return block


def virtual_block(plan, rank_reports: list[dict], summary: dict, run_dir: Path, links) -> dict | None:
    """The run's own replay (links: the run's link model; None: no replay, and on a GPU or under
    NCCL the reason)."""
    if not replayable(summary["device"], plan.backend):
        return {"skipped": NOT_REPLAYED}
    if links is None or any(r.get("events") is None for r in rank_reports):
        return None
    events = [r["events"] for r in sorted(rank_reports, key=lambda r: r["rank"])]
    directory = saved.save(run_dir, events)
    try:
        block = write_virtual(run_dir, events, summary, links, plan.timeline)
    except (ValueError, RuntimeError, KeyError) as e:  # a graph the replay cannot play: say why, keep the run
        log.warning("warning: the virtual-time replay failed: %s", e)
        return {"error": str(e), "events": directory}
    block["events"] = directory
    return block
