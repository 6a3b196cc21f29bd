"""The comparison's PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

OURS, THEIRS = "#4C72B0", "#DD8452"
OP_COLORS = {"all_reduce": "#4C72B0", "all_gather": "#55A868", "reduce_scatter": "#C44E52", "send": "#8172B2",
             "broadcast": "#937860", "all_to_all": "#DA8BC3"}
GROUP_COLORS = {"dp": "#4C72B0", "tp": "#55A868", "pp": "#8172B2", "world": "#937860", "cp": "#C44E52",
                "ep": "#DA8BC3", "edp": "#64B5CD"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def is_pytorch(strategy: str) -> bool:
    return strategy.startswith(("torch_", "accelerate_"))


def tokens_per_s(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ok) + 1.2))
    names = [r["strategy"] for r in ok][::-1]
    values = [r["tokens_per_s"] for r in ok][::-1]
    ax.barh(names, values, color=[THEIRS if is_pytorch(n) else OURS for n in names])
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s (orange: PyTorch / accelerate)")
    ax.set_title("Throughput per strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def bytes_per_step(rows: list[dict], summaries: dict[str, dict], path: Path) -> None:
    """Two stacked bar charts of one step's bytes sent (all ranks): by op and by group; a black
    mark where theory.py's closed form puts the total."""
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r["strategy"] in summaries]
    names = [r["strategy"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(ok) + 1.6), sharey=True)
    for ax, key, colors in ((axes[0], "by_op", OP_COLORS), (axes[1], "by_group", GROUP_COLORS)):
        left = [0.0] * len(names)
        labels = sorted({k for n in names for k in summaries[n]["comm"][key] if k != "recv"})
        for label in labels:
            widths = [summaries[n]["comm"][key].get(label, {}).get("sent_bytes", 0.0) / 1e6 for n in names]
            ax.barh(names, widths, left=left, color=colors.get(label), label=label)
            left = [a + b for a, b in zip(left, widths)]
        theory = [r["bytes_per_step_theory"] / 1e6 for r in ok]
        ax.scatter(theory, names, marker="|", s=300, color="black", label="theory", zorder=3)
        ax.set_xlabel("MB sent per step, all ranks")
        ax.set_title(f"bytes per step {key.replace('_', ' ')}")
        ax.legend(fontsize=7, loc="upper right")  # the top rows (single, dp) leave that corner free
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def memory_per_rank(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ok) + 1.2))
    for y, r in enumerate(ok):
        ranks = r["peak_memory_mb_by_rank"]
        ax.scatter(ranks, [y] * len(ranks), color=THEIRS if is_pytorch(r["strategy"]) else OURS, s=18)
    ax.set_yticks(range(len(ok)), [r["strategy"] for r in ok])
    ax.invert_yaxis()
    ax.set_xlabel("peak memory per rank, MB (one dot per rank; RSS on CPU)")
    ax.set_title("Peak memory per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
