"""The plan's two pictures: memory per device stacked by kind against the device's usable memory,
and step time stacked into compute, exposed communication and bubble (the rows shown in the table)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from parallel.planner.report import layout_label  # noqa: E402

GIB = 2**30
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers")
TIME_KINDS = ("compute", "exposed_comm", "bubble")


def _labels(rows: list[dict]) -> list[str]:
    return [f"{r['rank']}. {r['layout']['preset'] or r['layout']['strategy']} {layout_label(r['layout'])}"
            for r in rows]


def memory_plot(rows: list[dict], usable_bytes: float, capacity_bytes: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.8))
    labels = _labels(rows)
    left = [0.0] * len(rows)
    for kind in MEMORY_KINDS:
        values = [(r["memory_bytes_per_device"][kind] or 0) / GIB for r in rows]
        ax.barh(labels, values, left=left, label=kind)
        left = [a + b for a, b in zip(left, values)]
    ax.axvline(usable_bytes / GIB, color="black", linestyle="--", label="usable")
    ax.axvline(capacity_bytes / GIB, color="red", linestyle=":", label="capacity")
    ax.invert_yaxis()
    ax.set_xlabel("GiB per device (the device that holds the most)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def time_plot(rows: list[dict], path: Path) -> None:
    rows = [r for r in rows if r["step_time_s"]]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.8))
    labels = _labels(rows)
    left = [0.0] * len(rows)
    for kind in TIME_KINDS:
        values = [r["step_time_s"][kind] for r in rows]
        ax.barh(labels, values, left=left, label=kind.replace("_", " "))
        left = [a + b for a, b in zip(left, values)]
    measured = [(i, r["measured"]["step_time_s"]) for i, r in enumerate(rows) if r.get("measured")]
    if measured:
        ax.scatter([m for _, m in measured], [labels[i] for i, _ in measured], color="black", marker="x",
                   zorder=3, label="measured")
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (predicted)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
