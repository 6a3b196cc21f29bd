"""Every run's last step on one time axis: trace.json (Perfetto, chrome://tracing) and timeline.png.

Each rank sends rank 0 its last step: the phases its strategy marked (report/phases.py) and the
communication log's spans of that step (dist/commlog.py), in seconds from the rank's own step start,
with that start's wall-clock time, which places the ranks of one machine on one axis.

trace.json (Chrome's trace event format, which Perfetto opens): one process per global rank,
named with its coordinates ("rank 4 (pp 1, dp 0, tp 0)"), and in it three tracks:

    phases                  forward / backward / optimizer / ... one span each, labelled (F0, B3, ...)
    comm (blocked)          each blocking call or wait, named "op tag", args: group, bytes
    comm (posted)           each async call's post (the rank went on computing), with its bytes

Every call's bytes are on its call or post span, once (a wait carries none), so a rank's spans
add up to the bytes the log recorded for it in that step.

timeline.png draws the same for all ranks, one row each: the phases above, the communication
below coloured by group (blocked calls as bars, posts as ticks); what the tools send after the
step (the loss reduced for the log) is left out of the picture, not of trace.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel.dist.dims import SIZES, outermost_first
from parallel.pp.timeline import COLORS as PIPELINE_COLORS

PHASE_COLORS = {
    "forward": PIPELINE_COLORS["forward"], "backward": PIPELINE_COLORS["backward"], "weight": PIPELINE_COLORS["weight"],
    "recompute": "#E5AE38",
    "compute": "#4C9F8F", "optimizer": "#CCB974", "sync": "#9DB4C0", "p2p": PIPELINE_COLORS["p2p"],
    "other": "#DDDDDD", "unmarked": "#EEEEEE",
}
# The pipeline's p2p group in the pipeline timeline's "waiting for a neighbour" orange.
GROUP_COLORS = {"pp": PIPELINE_COLORS["wait"], "dp": "#C44E52", "tp": "#8C564B", "cp": "#17BECF", "ep": "#9467BD",
                "edp": "#BCBD22", "dp_cp": "#E377C2", "dp_shard": "#DD8452", "dp_replicate": "#55A868",
                "world": "#333333"}
OTHER_GROUP = "#7F7F7F"


def rank_label(rank: int, coords: dict, dims: dict) -> str:
    """"rank 4 (pp 1, dp 0, tp 0)": the global rank and its coordinates on the dimensions this run
    splits (all of pp, dp, tp when none is split, so a 3-D layout always reads the same way)."""
    shown = [d for d in outermost_first(SIZES) if dims.get(d, 1) > 1] or ["pp", "dp", "tp"]
    return f"rank {rank} ({', '.join(f'{d} {coords.get(d, 0)}' for d in shown)})"


def chrome_trace(traces: list[dict], labels: list[str]) -> dict:
    """Chrome trace events of every rank's last step (times in µs from the earliest rank's start)."""
    origin = min(t["origin_wall"] for t in traces)
    events = []
    for rank, (t, label) in enumerate(zip(traces, labels)):
        offset = t["origin_wall"] - origin
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for tid, name in enumerate(("phases", "comm (blocked)", "comm (posted)")):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for p in t["phases"]:
            events.append({"name": f"{p['phase']} {p['label']}".strip(), "cat": p["phase"], "ph": "X", "pid": rank,
                           "tid": 0, "ts": (offset + p["start"]) * 1e6, "dur": (p["end"] - p["start"]) * 1e6})
        for s in t["spans"]:
            events.append({
                "name": f"{s['op']} {s['tag']}", "cat": f"comm,{s['group']},{s['kind']}", "ph": "X", "pid": rank,
                "tid": 1 if s["blocked"] else 2, "ts": (offset + s["start"]) * 1e6,
                "dur": max(s["end"] - s["start"], 0.0) * 1e6,
                "args": {k: s[k] for k in ("op", "group", "tag", "kind", "payload_bytes", "sent_bytes")},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def from_chrome(doc: dict) -> tuple[list[dict], list[str]]:
    """The traces and labels `chrome_trace` was given, back from its events, on one time axis (each
    rank's `origin_wall` 0, its times from the earliest rank's start): enough to draw the timeline
    again from a trace.json, as launch.compare does for its report."""
    labels: dict[int, str] = {}
    traces: dict[int, dict] = {}
    for e in doc["traceEvents"]:
        t = traces.setdefault(e["pid"], {"origin_wall": 0.0, "phases": [], "spans": []})
        if e["ph"] == "M":
            if e["name"] == "process_name":
                labels[e["pid"]] = e["args"]["name"]
            continue
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        if e["tid"] == 0:
            t["phases"].append({"phase": e["cat"], "start": start, "end": end})
        else:
            t["spans"].append({"group": e["args"]["group"], "blocked": e["tid"] == 1, "start": start, "end": end})
    ranks = sorted(traces)
    return [traces[r] for r in ranks], [labels[r] for r in ranks]


def draw_trace_file(trace: Path, path: Path, title: str) -> None:
    """timeline.png drawn from a written trace.json (or trace_virtual.json)."""
    draw_timeline(*from_chrome(json.loads(Path(trace).read_text())), path, title)


def draw_timeline(traces: list[dict], labels: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(t["origin_wall"] for t in traces)
    fig, ax = plt.subplots(figsize=(13, 0.55 * len(traces) + 2.0))
    phases_seen, groups_seen = set(), set()
    for row, t in enumerate(traces):
        offset = t["origin_wall"] - origin
        bars: dict[str, list] = {}
        for p in t["phases"]:
            bars.setdefault(p["phase"], []).append(((offset + p["start"]) * 1e3, (p["end"] - p["start"]) * 1e3))
        for phase, spans in bars.items():  # one call per colour: thousands of spans draw in a moment
            ax.broken_barh(spans, (row - 0.42, 0.5), facecolors=PHASE_COLORS[phase])
            phases_seen.add(phase)
        blocked: dict[str, list] = {}
        posted: dict[str, list] = {}
        end = max((p["end"] for p in t["phases"]), default=0.0)
        for s in t["spans"]:
            if s["start"] >= end:
                continue  # after the step: the loss reduced for the log (in trace.json)
            start = (offset + s["start"]) * 1e3
            width = (s["end"] - s["start"]) * 1e3
            (blocked if s["blocked"] else posted).setdefault(s["group"], []).append((start, width))
        for group, spans in blocked.items():
            ax.broken_barh(spans, (row + 0.12, 0.3), facecolors=GROUP_COLORS.get(group, OTHER_GROUP))
            groups_seen.add(group)
        for group, spans in posted.items():
            ax.scatter([s for s, _ in spans], [row + 0.27] * len(spans), marker="|", s=60,
                       color=GROUP_COLORS.get(group, OTHER_GROUP), linewidths=1)
            groups_seen.add(group)
    ax.set_yticks(range(len(traces)), labels, fontsize=8)
    ax.set_ylim(len(traces) - 0.5, -0.5)
    ax.set_xlabel("ms since the first rank's step began | upper bar: phases | lower bar: communication blocked "
                  "in, by group (ticks: async posts)", fontsize=8)
    ax.set_title(title, fontsize=9)
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in PHASE_COLORS if p in phases_seen]
    handles += [Patch(color=GROUP_COLORS.get(g, OTHER_GROUP), label=f"comm {g}") for g in sorted(groups_seen)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.5 / (len(traces) + 2)),
              fontsize=7, ncol=min(len(handles), 9), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_title(summary: dict, step: int) -> str:
    p = summary["parallel"]
    layout = f"dp {p['dp']} x tp {p['tp']} x pp {p['pp']}" + (f" x cp {p['cp']}" if p.get("cp", 1) > 1 else "")
    title = (f"{summary['strategy']}: {layout}, {p['microbatches']} microbatch(es) | step {step} | "
             f"world {summary['world_size']}")
    pipe = summary.get("pipeline")
    if pipe:
        closed = pipe["bubble_closed_form"]  # None where no closed form is claimed (ZB-V below m = 2p-1)
        title += (f"\n{pipe['schedule']}: bubble measured {pipe['bubble_measured']:.1%} (first pipeline), simulated "
                  f"{pipe['bubble_simulated']:.1%}, closed form {'none' if closed is None else f'{closed:.1%}'}")
    return title


def write_run_trace(run_dir: Path, rank_reports: list[dict], summary: dict, draw: bool) -> dict | None:
    """trace.json (always) and timeline.png (when `draw`) of the last step; the summary's `trace` block."""
    traces = [r["trace"] for r in rank_reports]
    if any(t is None for t in traces):
        return None
    labels = [rank_label(r["rank"], r["coords"], summary["parallel"]) for r in rank_reports]
    (run_dir / "trace.json").write_text(json.dumps(chrome_trace(traces, labels)))
    step = traces[0]["step"]
    if draw:
        draw_timeline(traces, labels, run_dir / "timeline.png", timeline_title(summary, step))
    return {"step": step, "trace": "trace.json", "timeline": "timeline.png" if draw else None,
            "spans": sum(len(t["spans"]) for t in traces), "phases": sum(len(t["phases"]) for t in traces)}
