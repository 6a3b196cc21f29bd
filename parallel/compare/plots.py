"""The comparison's PNG plots (matplotlib, no display needed). MB = 10^6 bytes in every plot."""

from __future__ import annotations

from pathlib import Path

from parallel.compare.rows import MB

OURS, THEIRS = "#4C72B0", "#DD8452"
# The two panels of the bytes plot mean different things (ops, groups): two palettes, no colour shared.
OP_COLORS = {"all_reduce": "#1F77B4", "all_gather": "#2CA02C", "reduce_scatter": "#D62728", "send": "#9467BD",
             "broadcast": "#8C564B", "all_to_all": "#17BECF"}
GROUP_COLORS = {"dp": "#FF7F0E", "tp": "#E377C2", "pp": "#BCBD22", "cp": "#7F7F7F", "ep": "#393B79",
                "edp": "#AD494A", "dp_cp": "#637939", "dp_shard": "#FFBB78", "dp_replicate": "#2CA02C",
                "world": "#000000"}
BREAKDOWN_COLORS = {"compute": "#4C72B0", "exposed_comm": "#C44E52", "bubble": "#DD8452", "optimizer": "#CCB974",
                    "other": "#AAAAAA"}
# Model state and activations per rank (the memory plot), in the order they are stacked.
MEMORY_PARTS = {"param_bytes": ("parameters", "#4C72B0"), "grad_bytes": ("gradients", "#55A868"),
                "optimizer_bytes": ("optimizer state", "#CCB974"),
                "activation_peak_bytes": ("activations (peak)", "#C44E52")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def is_pytorch(row: dict) -> bool:
    """A baseline row: PyTorch's own (its rows have no PyTorch counterpart of their own, and are one)."""
    from parallel.registry import spec_of

    return "baseline" in spec_of(row["runs_as"]).tags


def tokens_interval(row: dict) -> tuple[float, float, str]:
    """(low, high, what) of a row's tokens/s: the rounds' min-max, or else the slowest and fastest
    timed step of its run."""
    if row.get("tokens_per_s_lo") is not None:
        return row["tokens_per_s_lo"], row["tokens_per_s_hi"], "rounds"
    per_step = row["tokens_per_step"]
    return per_step / (row["step_ms_max"] / 1e3), per_step / (row["step_ms_min"] / 1e3), "steps"


def tokens_per_s(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok"][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ok) + 1.5))
    names = [r["strategy"] + (" (noisy)" if r.get("noisy") else "") for r in ok]
    values = [r["tokens_per_s"] for r in ok]
    intervals = [tokens_interval(r) for r in ok]
    # The value is one of the steps the interval is made of (the median), so an end can equal it and,
    # recomputed from the step times, differ from it by a rounding error: never below zero.
    errors = [[max(0.0, v - lo) for v, (lo, _, _) in zip(values, intervals)],
              [max(0.0, hi - v) for v, (_, hi, _) in zip(values, intervals)]]
    ax.barh(names, values, color=[THEIRS if is_pytorch(r) else OURS for r in ok], xerr=errors, capsize=3,
            error_kw={"elinewidth": 1, "ecolor": "black"})
    for y, (v, (_, hi, _)) in enumerate(zip(values, intervals)):
        ax.text(hi, y, f" {v:.0f}", va="center", fontsize=8)
    what = {kind for _, _, kind in intervals}
    bars = "min-max over the rounds" if what == {"rounds"} else "slowest and fastest timed step" if what == {"steps"} \
        else "rounds' min-max, or timed steps' range"
    ax.set_xlabel(f"tokens/s (orange: PyTorch / accelerate; error bars: {bars})")
    ax.set_title("Throughput per strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def time_breakdown(rows: list[dict], path: Path) -> None:
    """Per strategy one stacked bar of its median step: compute, exposed comm, bubble, optimizer, other."""
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r.get("compute_ms") is not None]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(ok) + 2.0))
    names = [r["strategy"] + (" *" if r.get("exposed_comm_share") is None else "") for r in ok]
    left = [0.0] * len(ok)
    for part, color in BREAKDOWN_COLORS.items():
        widths = [r[f"{part}_ms"] or 0.0 for r in ok]
        ax.barh(names, widths, left=left, color=color, label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    ax.scatter([r["step_ms"] for r in ok], names, marker="|", s=250, color="black", label="step time", zorder=3)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step, mean over ranks (* waits inside PyTorch, counted as compute)")
    ax.set_title("Where each step's time goes")
    # The legend in figure coordinates, just under the axis label, whatever the number of bars.
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=6, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (0.35 * len(ok) + 2.0), 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def bytes_per_step(rows: list[dict], summaries: dict[str, dict], path: Path) -> None:
    """Two stacked bar charts of one step's bytes sent (all ranks): by op and by group; a black
    mark where the closed form puts the total."""
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r["strategy"] in summaries]
    names = [r["strategy"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(ok) + 1.6), sharey=True)
    for ax, key, colors, what in ((axes[0], "by_op", OP_COLORS, "op"), (axes[1], "by_group", GROUP_COLORS, "group")):
        left = [0.0] * len(names)
        labels = sorted({k for n in names for k in summaries[n]["comm"][key] if k != "recv"})
        for label in labels:
            widths = [summaries[n]["comm"][key].get(label, {}).get("sent_bytes", 0.0) / MB for n in names]
            ax.barh(names, widths, left=left, color=colors.get(label, "#999999"), label=label)
            left = [a + b for a, b in zip(left, widths)]
        theory = [r["bytes_per_step_theory"] / MB for r in ok]
        ax.scatter(theory, names, marker="|", s=300, color="black", label="theory", zorder=3)
        ax.set_xlabel("MB sent per step, all ranks")
        ax.set_title(f"bytes per step by {what}")
        ax.legend(fontsize=7, loc="upper right", title=what, title_fontsize=7)  # the top rows leave that corner free
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def memory_per_rank(rows: list[dict], summaries: dict[str, dict], path: Path) -> None:
    """Left: per rank, from zero, the model state it holds after the last step (parameters,
    gradients, optimizer state) and the activations it held for backward at the step's peak,
    stacked. Right: each rank's peak process memory (RSS on CPU, allocator on GPU)."""
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r["strategy"] in summaries]
    bars, labels = [], []  # one bar per rank, grouped by strategy
    for r in ok:
        for rank, entry in enumerate(summaries[r["strategy"]]["memory"]["by_rank"]):
            bars.append(entry)
            labels.append(f"{r['strategy']} r{rank}" if rank == 0 else f"r{rank}")
    fig, (ax, ax_rss) = plt.subplots(1, 2, figsize=(13, 0.16 * len(bars) + 2.3), sharey=True,
                                     gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(len(bars)))
    left = [0.0] * len(bars)
    for key, (label, color) in MEMORY_PARTS.items():
        widths = [b.get(key, 0) / MB for b in bars]
        ax.barh(y, widths, left=left, color=color, label=label, height=0.8)
        left = [a + w for a, w in zip(left, widths)]
    ax.set_yticks(y, labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("MB per rank: model state after the last step, activations at the step's peak")
    ax.set_title("What each rank holds (measured from its tensors)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.6 / (len(bars) + 2)), ncol=4, frameon=False)
    colors = [THEIRS if is_pytorch(r) else OURS for r in ok for _ in summaries[r["strategy"]]["memory"]["by_rank"]]
    ax_rss.barh(y, [b["peak_allocator_bytes"] / MB for b in bars], height=0.8, color=colors)
    ax_rss.set_xlim(left=0)
    ax_rss.set_xlabel("peak MB per rank (CPU: RSS, ~300 MB of it runtime; GPU: allocator)")
    ax_rss.set_title("Peak process memory")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def timelines(summaries: dict[str, dict], run_dirs: dict[str, Path], out: Path) -> dict[str, str]:
    """timeline_<strategy>.png in `out` for every run that wrote a trace.json, drawn here from that
    file: the sweep's runs draw none themselves (run.timeline=false), so matplotlib is started once
    for the whole sweep rather than in every run. Returns strategy -> file name."""
    from parallel.report.trace import draw_trace_file, timeline_title

    drawn = {}
    for strategy, summary in summaries.items():
        trace = summary.get("trace")
        if trace:
            drawn[strategy] = f"timeline_{strategy}.png"
            draw_trace_file(run_dirs[strategy] / trace["trace"], out / drawn[strategy],
                            timeline_title(summary, trace["step"]))
    return drawn
