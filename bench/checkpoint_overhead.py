"""What a checkpoint costs the training loop: no saves, against saves gathered or sharded, sync or async.

    python -m bench.checkpoint_overhead                       # world 2, zero3, model=tiny, 3 rounds
    python -m bench.checkpoint_overhead world=4 rounds=5 variants=none,sync,async model=small

Each round runs `launch.train` once per variant (in a rotating order, so that the machine's drift
falls on every variant alike), the same steps from the same seed, saving every `every` steps. A
run's time per step is its slowest rank's timed steps plus what its saves after them blocked it,
divided by the timed steps (summary.json's `checkpoints.loop_s_by_rank`: each rank's own sum, on
its host clock, so a rank that waits in the next step's collective for rank 0's save is counted
once). The overhead of a variant is its time per step minus the no-save run's of the same round.

Printed per variant: the median over rounds of the time per step, of the overhead per step and
per save, of what a save blocked the loop (slowest rank) and of the background write, each with
its interval (the lowest and highest round), and the bytes rank 0 and the busiest other rank
wrote per save. The losses of every run must be equal (saves never change training).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness import rotation, run, shown, split_args, train_command

DEFAULTS = {"world": "2", "rounds": "3", "steps": "14", "every": "2", "preset": "zero3", "model": "tiny",
            "variants": "none,sync,async,sharded,sharded_async"}
WARMUP = 2
MODES = {
    "none": [],
    "sync": [],
    "async": ["train.checkpoint_async=true"],
    "sharded": ["train.checkpoint_sharded=true"],
    "sharded_async": ["train.checkpoint_sharded=true", "train.checkpoint_async=true"],
}
CLOCK = "the host wall clock (time.perf_counter) of each rank; a run counts its slowest rank"


def _overrides(variant: str, opts: dict, extra: list[str]) -> list[str]:
    every = 0 if variant == "none" else int(opts["every"])
    return [f"model={opts['model']}", f"parallel={opts['preset']}", f"train.steps={opts['steps']}",
            f"train.warmup_steps={WARMUP}",
            "train.global_batch=16", "data.max_bytes=1000000", "train.peak_flops=1e11", "run.timeline=false",
            f"train.checkpoint_every={every}", *MODES[variant], *extra]


def _figures(summary: dict) -> dict:
    """One run's time per step (saves included), and its saves' blocking, writing and bytes."""
    block = summary["checkpoints"]
    timed = len(summary["losses"]) - summary["warmup_steps"]
    saves = [s for s in block["saves"] if s["step"] > summary["first_step"] + summary["warmup_steps"]]
    return {
        "per_step": max(block["loop_s_by_rank"]) / timed,
        "saves": len(saves),
        "blocked": [s["max_blocked_s"] for s in saves],
        "write": [max(r["write_s"] + r["publish_s"] for r in s["ranks"]) for s in saves],
        "rank0_bytes": [s["ranks"][0]["bytes"] for s in saves],
        "other_bytes": [max((r["bytes"] for r in s["ranks"][1:]), default=0) for s in saves],
        "losses": summary["losses"],
    }


def _cell(values: list[float], scale: float = 1e3) -> str:
    """Median [lowest, highest] in milliseconds."""
    return f"{statistics.median(values) * scale:.1f} [{min(values) * scale:.1f}, {max(values) * scale:.1f}]"


def report(by_variant: dict[str, list[dict]], opts: dict) -> None:
    base = [f["per_step"] for f in by_variant.get("none", [])]
    print(f"\nclock: {CLOCK}; medians over {opts['rounds']} rounds [lowest, highest round]; milliseconds")
    print("| variant | time per step | overhead per step | overhead per save | save blocks the loop "
          "| write + publish | MB per save: rank 0 / busiest other |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant, runs in by_variant.items():
        per_step = [f["per_step"] for f in runs]
        over = [f["per_step"] - b for f, b in zip(runs, base)] if base and variant != "none" else None
        saves = runs[0]["saves"]
        per_save = [o * (len(runs[0]["losses"]) - WARMUP) / saves for o in over] if over and saves else None
        blocked = [statistics.median(f["blocked"]) for f in runs if f["blocked"]]
        write = [statistics.median(f["write"]) for f in runs if f["write"]]
        mb = (f"{statistics.median(runs[0]['rank0_bytes']) / 1e6:.2f} / "
              f"{statistics.median(runs[0]['other_bytes']) / 1e6:.2f}") if saves else "-"
        print(f"| {variant} | {_cell(per_step)} | {_cell(over) if over else '-'} | "
              f"{_cell(per_save) if per_save else '-'} | {_cell(blocked) if blocked else '-'} | "
              f"{_cell(write) if write else '-'} | {mb} |")


def main(argv: list[str]) -> None:
    extra, opts = split_args(argv, DEFAULTS)
    variants = opts["variants"].split(",")
    unknown = [v for v in variants if v not in MODES]
    if unknown:
        sys.exit(f"variants={opts['variants']}: unknown {unknown}; choose from {', '.join(MODES)}")
    by_variant: dict[str, list[dict]] = {v: [] for v in variants}
    root = Path(tempfile.mkdtemp(prefix="checkpoint_overhead-"))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; runs under {root}")
    for r in range(int(opts["rounds"])):
        for variant in rotation(variants, r):
            run_dir = root / f"round{r}-{variant}"
            cmd = train_command(int(opts["world"]), _overrides(variant, opts, extra), run_dir)
            if r == 0 and variant == variants[0]:
                print(f"e.g. {shown(cmd)}")
            by_variant[variant].append(_figures(run(cmd, run_dir)))
    losses = {tuple(f["losses"]) for runs in by_variant.values() for f in runs}
    print(f"losses equal in every run: {len(losses) == 1}; load average at end: {os.getloadavg()[0]:.1f}")
    report(by_variant, opts)


if __name__ == "__main__":
    main(sys.argv[1:])
