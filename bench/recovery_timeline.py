"""What one failure costs, part by part: the recovery timeline of docs/reliability.md.

    python -m bench.recovery_timeline                                   # dp, world 4, 3 jobs
    python -m bench.recovery_timeline parallel=zero3 repeats=5 plot=docs/recovery_timeline.png

Each job is `torchrun --max-restarts=1` with `train.resume=auto` and a checkpoint every `every`
steps, whose rank 1 SIGKILLs itself before step `kill_at` (`train.fail_mode=kill`); torchrun
restarts every rank and the job finishes. The job's summary.json holds one `recovery` entry
(parallel/reliability/recovery.py): detection, teardown, restart, rendezvous, set-up, checkpoint
load and the recomputed steps, each measured on its own, against the downtime measured by its two
ends (the fault, and the new attempt back at the fault's step). The bench prints each part's
median over the jobs with its range, its share of the downtime, and what the parts leave
unexplained; `plot=` draws the median job's timeline as one bar.

Options (`key=value`): world (4), repeats (3), kill_at (5), steps (10), every (2), plot (none);
anything else is an override of the training config (default `model=tiny parallel=dp`).
Clock: the wall clock (unix time stamps across processes, each process's own clock inside one).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness import RunFailed, run, shown, split_args
from parallel.reliability.recovery import PARTS

DEFAULTS = {"world": "4", "repeats": "3", "kill_at": "5", "steps": "10", "every": "2", "plot": ""}
TRAINING = ["model=tiny", "parallel=dp", "train.global_batch=8", "data.max_bytes=200000"]
COLORS = {"detection_s": "#C44E52", "teardown_s": "#DD8452", "restart_s": "#CCB974", "rendezvous_s": "#4C72B0",
          "setup_s": "#64B5CD", "load_s": "#55A868", "recompute_s": "#8172B2"}


def job_command(opts: dict[str, str], overrides: list[str], run_dir: Path) -> list[str]:
    """One job killed once and restarted once by torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts['world']}",
            "--max-restarts=1", "-m", "launch.train", *TRAINING, *overrides, f"train.steps={opts['steps']}",
            f"train.checkpoint_every={opts['every']}", "train.resume=auto", "train.fail_mode=kill",
            f"train.fail_at_step={opts['kill_at']}", "train.fail_rank=1", f"run.dir={run_dir}"]


def table(entries: list[dict]) -> list[str]:
    """The markdown table: each part's median [lowest, highest] and its share of the median downtime."""
    down = statistics.median(e["downtime_s"] for e in entries)
    lines = ["| part | seconds, median [lowest, highest] | share of the downtime |", "| --- | --- | --- |"]
    for key in (*PARTS, "unexplained_s", "downtime_s"):
        values = [e[key] for e in entries]
        mid = statistics.median(values)
        lines.append(f"| {key[:-2]} | {mid:.2f} [{min(values):.2f}, {max(values):.2f}] | {100 * mid / down:.0f}% |")
    return lines


def plot_timeline(entry: dict, path: Path, title: str) -> None:
    """One failure as one horizontal bar: each part where it falls after the fault."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.4))
    start = 0.0
    for key in PARTS:
        width = max(entry[key], 0.0)
        ax.barh(0, width, left=start, color=COLORS[key], edgecolor="white", label=f"{key[:-2]} {entry[key]:.2f} s")
        start += width
    ax.axvline(entry["downtime_s"], color="black", linestyle="--", label=f"downtime {entry['downtime_s']:.2f} s")
    ax.set_yticks([])
    ax.set_xlabel("seconds after the fault (wall clock)")
    ax.set_title(title, fontsize=9)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45), frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str]) -> None:
    overrides, opts = split_args(argv, DEFAULTS)
    entries = []
    with tempfile.TemporaryDirectory(prefix="recovery-") as tmp:
        for repeat in range(int(opts["repeats"])):
            run_dir = Path(tmp) / f"job{repeat}"
            cmd = job_command(opts, overrides, run_dir)
            if repeat == 0:
                print(f"each job: {shown(cmd)}")
            try:
                summary = run(cmd, run_dir)
            except RunFailed as e:
                sys.exit(f"error: {e}")
            entries.extend(summary["recovery"])
            entry = summary["recovery"][-1]
            print(f"job {repeat}: downtime {entry['downtime_s']:.2f} s, parts {entry['explained_s']:.2f} s, "
                  f"survivors stamped {entry['survivors_detected']}", flush=True)
    print(f"\n{len(entries)} failures, world {opts['world']}, rank 1 killed before step {opts['kill_at']}, "
          f"checkpoint every {opts['every']} steps; clock: the wall clock\n")
    print("\n".join(table(entries)))
    if opts["plot"]:
        median_job = sorted(entries, key=lambda e: e["downtime_s"])[len(entries) // 2]
        plot_timeline(median_job, Path(opts["plot"]), f"one failure, the median of {len(entries)} "
                      f"(world {opts['world']}, {' '.join(overrides) or 'dp'}, tiny model)")
        print(f"\nwrote {opts['plot']}")


if __name__ == "__main__":
    main(sys.argv[1:])
