"""The zero-bubble figures of docs/pipeline-zero-bubble.md, from `launch.compare` sweeps.

    python -m bench.zero_bubble_report SWEEP_DIR [SWEEP_DIR ...] [--timelines OUT.png] [--simulated OUT.png]

Each SWEEP_DIR is a `python -m launch.compare` run directory (results.json, and one run directory
per strategy with its summary.json and trace.json). Printed, as markdown:

  * per pipeline run of ours: p, m, the bubble in closed form with the run's own mean F, B and W
    wall times (the summary's pipeline block) and measured by the wall clock; the same closed form
    with the virtual clock's F, B and W (CPU time) and the replayed (virtual) bubble; tokens/s in
    the sweep's leading clock;
  * per run, PyTorch's too: tokens/s and the ratio of ours to PyTorch's (the comparison's pairing);
  * per run of ours: the peak activations per rank, simulated (chunk-microbatches held at once)
    and measured (MB saved for backward at the step's peak, the ActivationMeter's).

`--timelines` draws the measured timelines of the runs of one sweep (the last given) one under
another, from their trace.json; `--simulated` draws the simulator's timelines of the same
schedules at F = B = W (the closed forms' own picture), for comparison.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parallel.pp.placement import Placement
from parallel.pp.schedules import closed_form_bubble, schedule_placement
from parallel.pp.simulator import simulate_schedule, split_costs
from parallel.pp.timeline import COLORS

MB = 2**20


def load(sweep: Path) -> list[dict]:
    rows = json.loads((sweep / "results.json").read_text())["rows"]
    for row in rows:
        # A sweep of several rounds keeps each round's runs in round<k>/: the bubbles are round 0's,
        # the tokens/s and ratios the rounds' medians (results.json).
        path = sweep / row["strategy"] / "summary.json"
        if not path.exists():
            path = sweep / "round0" / row["strategy"] / "summary.json"
        row["summary"] = json.loads(path.read_text()) if row["status"] == "ok" and path.exists() else None
    return rows


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def virtual_closed_form(summary: dict) -> float | None:
    """The schedule's closed form with the virtual clock's F, B and W (CPU time per chunk-microbatch)."""
    pipe, vpipe = summary["pipeline"], (summary.get("virtual") or {}).get("pipeline")
    if not vpipe:
        return None
    v = pipe["virtual_stages"]
    closed = closed_form_bubble(pipe["schedule"], pipe["stages"], pipe["microbatches"], v,
                                vpipe["mean_forward_s"] * v, vpipe["mean_backward_s"] * v, vpipe["mean_weight_s"] * v)
    return None if closed is None else float(closed)


def bubble_table(sweeps: list[list[dict]]) -> None:
    print("| schedule | p | m | closed form (wall F, B, W) | measured (wall) | closed form (virtual F, B, W) "
          "| virtual | tokens/s | PyTorch's tokens/s | ours / PyTorch's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in sweeps:
        by_name = {r["strategy"]: r for r in rows}
        for row in rows:
            s = row["summary"]
            if row["runs_as"] != "pp" and not (row["status"] != "ok" and row["strategy"].startswith("pp_")):
                continue
            if s is None:
                why = row["error"].split(": ", 1)[-1] if row["error"].startswith("exit ") else row["error"]
                print(f"| {row['strategy']} | | | refused: {why.split(' (')[0]} | | | | | | |")
                continue
            pipe, par = s["pipeline"], s["parallel"]
            vpipe = (s.get("virtual") or {}).get("pipeline") or {}
            theirs = by_name.get(row["baseline"]) if row.get("baseline") else None
            lo_hi = f" ({row['ratio_lo']:.2f}-{row['ratio_hi']:.2f})" if row.get("ratio_lo") is not None else ""
            ratio = f"{row['ratio_to_baseline']:.2f}{lo_hi}" if theirs else "-"
            print(f"| {pipe['schedule']} | {par['pp']} | {par['microbatches']} | {pct(pipe['bubble_closed_form'])} | "
                  f"{pct(pipe['bubble_measured'])} | {pct(virtual_closed_form(s))} | {pct(vpipe.get('bubble'))} | "
                  f"{row['tokens_per_s']:.0f} ({row.get('clock', 'wall')}) | "
                  + (f"{theirs['tokens_per_s']:.0f} ({theirs['strategy']}) | {ratio} |" if theirs else "- | - |"))


def activation_table(rows: list[dict]) -> None:
    print("| schedule | p | m | held, simulated (chunk-microbatches per rank) | measured (MB per rank) |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        s = row["summary"]
        if s is None or row["runs_as"] != "pp":
            continue
        pipe, par = s["pipeline"], s["parallel"]
        measured = s["memory"]["activations_bytes_measured"]
        print(f"| {pipe['schedule']} | {par['pp']} | {par['microbatches']} | {pipe['peak_activations_simulated']} | "
              f"{[round(b / MB, 1) for b in measured]} |")


def _draw(ax, bars: list[tuple[int, float, float, str]], title: str, ranks: int) -> None:
    """bars: (rank, start, width, kind)."""
    for rank, start, width, kind in bars:
        ax.barh(rank, width, left=start, height=0.8, color=COLORS[kind], edgecolor="white", linewidth=0.2)
    ax.set_yticks(range(ranks), [f"r{r}" for r in range(ranks)], fontsize=6)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=7, loc="left")
    ax.tick_params(axis="x", labelsize=6)


def draw_measured(rows: list[dict], sweep: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs = [r for r in rows if r["summary"] is not None and r["runs_as"] == "pp"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.05 * len(runs) + 0.4), squeeze=False)
    for ax, row in zip(axes[:, 0], runs):
        pipe = row["summary"]["pipeline"]
        events = [e for e in json.loads((sweep / row["strategy"] / "trace.json").read_text())["traceEvents"]
                  if e.get("ph") == "X"]
        bars = [(e["tid"], e["ts"] / 1e3, e["dur"] / 1e3, e["cat"]) for e in events]
        _draw(ax, bars, f"{pipe['schedule']}: measured {pct(pipe['bubble_measured'])}, simulated "
                        f"{pct(pipe['bubble_simulated'])}, closed form {pct(pipe['bubble_closed_form'])} (ms)",
              row["summary"]["parallel"]["pp"])
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="lower center", ncol=5, fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def draw_simulated(schedules: list[tuple[str, int, int, int]], out: Path) -> None:
    """(schedule, p, m, v) at F = B = W = 1 per rank's share: the pictures the closed forms describe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kinds = {"F": "forward", "B": "backward", "W": "weight"}
    fig, axes = plt.subplots(len(schedules), 1, figsize=(8, 1.05 * len(schedules) + 0.4), squeeze=False)
    for ax, (schedule, p, m, v) in zip(axes[:, 0], schedules):
        splits = schedule in ("zbh1", "zbv", "dualpipev")
        # Unsplit schedules run B and W as one action of B + W: the same total work.
        result = simulate_schedule(schedule, p, m, v, split_costs(1, 1, 1) if splits else split_costs(1, 2, 0))
        bars = [(s.rank, s.start, s.end - s.start, kinds[s.action.op]) for s in result.spans if s.action.op in kinds]
        place: Placement = schedule_placement(schedule, p, v)
        _draw(ax, bars, f"{schedule} ({place.shape} placement): bubble {pct(result.bubble_fraction)} at F = B = W", p)
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in ("forward", "backward", "weight")],
               loc="lower center", ncol=3, fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> None:
    options = {"--timelines": None, "--simulated": None}
    sweeps = []
    args = iter(argv)
    for arg in args:
        if arg in options:
            options[arg] = Path(next(args))
        else:
            sweeps.append(Path(arg))
    loaded = [load(s) for s in sweeps]
    bubble_table(loaded)
    print()
    for rows in loaded:
        activation_table(rows)
        print()
    if options["--timelines"]:
        draw_measured(loaded[-1], sweeps[-1], options["--timelines"])
    if options["--simulated"]:
        runs = [r["summary"]["parallel"] for r in loaded[-1] if r["summary"] is not None and r["runs_as"] == "pp"]
        draw_simulated([(p["schedule"], p["pp"], p["microbatches"], p["virtual_stages"]) for p in runs],
                       options["--simulated"])


if __name__ == "__main__":
    main(sys.argv[1:])
