"""`python -m bench.virtual_time`: the options, the runs of every check asked for, then the tables
(bench/virtual_time/__init__.py says what each check claims)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench import harness
from bench.virtual_time import runs, tables
from parallel.replay.probe import figure_overrides, measure_once, median_figures
from parallel.report.mfu import usable_cores

CHECKS = ("stability", "loaded", "faithful", "contention", "pipelines", "network")
OPTIONS = {"checks": ",".join(CHECKS), "model": "tiny", "steps": "8", "repeats": "3", "rounds": "5",
           "loopback": "sampled", "probes": "5", "out": "runs/virtual-bench"}


def options(argv: list[str]) -> dict[str, str]:
    """The options, every one checked before any run."""
    opts = harness.options(argv, OPTIONS)
    if opts["loopback"] not in ("sampled", "once"):
        raise SystemExit(f"loopback={opts['loopback']!r}: sampled or once")
    unknown = set(opts["checks"].split(",")) - set(CHECKS)
    if unknown:
        raise SystemExit(f"unknown check(s) {', '.join(sorted(unknown))}: {', '.join(CHECKS)}")
    if int(opts["repeats"]) < 2:
        raise SystemExit(f"repeats={opts['repeats']!r}: at least 2 (the stability check compares repeats)")
    return opts


def probe_before(batch: runs.Batch, probes: int) -> dict:
    """One probe for every run (2 ranks, one per core): each figure the median of `probes` probe runs."""
    figures = measure_once(probes)
    batch.commands.append(f"# {probes} x, the median of each figure:\n"
                          "python -m torch.distributed.run --standalone --nproc-per-node=2 -m parallel.replay.probe")
    if batch.sampled:
        batch.commands.append("# before every run below, once: python -m torch.distributed.run --standalone "
                              "--nproc-per-node=2 -m parallel.replay.probe")
    batch.common += figure_overrides(figures)
    return figures


def make_runs(batch: runs.Batch, checks: list[str], opts: dict[str, str]) -> dict:
    """Every check's runs first, the tables after: with `sampled`, the tables need the probes of the
    whole batch."""
    count, rounds = int(opts["repeats"]), int(opts["rounds"])
    made: dict = {}
    if "stability" in checks or "loaded" in checks:
        made["stability"] = runs.repeats(batch, count, "w4once")
    if "loaded" in checks:
        made["loaded"], made["spinners"] = runs.loaded_repeats(batch, count)
    if "contention" in checks:
        made["contention"] = runs.repeats(batch, count, "w4rr", together=False,
                                          extra=["train.pin_cores=round_robin"])
    if "faithful" in checks:
        made["faithful"] = runs.faithful_runs(batch, rounds)
    if "pipelines" in checks:
        made["pipelines"] = runs.pipeline_runs(batch)
    if "network" in checks:
        made["network"] = runs.network_runs(batch, rounds)
    return made


def tables_of(made: dict, checks: list[str], view: tables.View) -> list[str]:
    parts = []
    if "stability" in checks:
        parts.append(tables.stability(made["stability"], view, "Stability"))
    if "loaded" in checks:
        parts.append(tables.stability(made["loaded"], view, f"Loaded, {made['spinners']} busy processes beside them",
                                      base=made["stability"]))
    if "contention" in checks:
        parts.append(tables.contention(made["contention"], view))
    if "faithful" in checks:
        parts.append(tables.faithful(made["faithful"], view))
    if "pipelines" in checks:
        parts.append(tables.pipelines(made["pipelines"], view))
    if "network" in checks:
        parts.append(tables.network(made["network"], view))
    return parts


def main(argv: list[str]) -> None:
    opts = options(argv)
    checks = opts["checks"].split(",")
    out = Path(opts["out"]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    batch = runs.Batch(out, [f"model={opts['model']}", f"train.steps={opts['steps']}"],
                       sampled=opts["loopback"] == "sampled")
    started = time.strftime("%Y-%m-%d %H:%M")
    before = probe_before(batch, int(opts["probes"]))
    made = make_runs(batch, checks, opts)
    probes = [f"loopback probed bound before the batch: {tables.said(before)}"]
    if batch.sampled:
        median = median_figures(batch.samples)
        view = tables.View(f"the median of {len(batch.samples)} probes across the batch", median)
        probes.append(f"{len(batch.samples)} probe runs, one before each run: median {tables.said(median)}; "
                      f"range {tables.spread(batch.samples)}")
        (out / "probes.json").write_text(json.dumps(batch.samples, indent=1) + "\n")
    else:
        view = tables.View("the probe before the batch")
    text = "\n".join([f"# virtual time validation, {started}, {usable_cores()} cores, model {opts['model']}, "
                      f"{opts['steps']} steps, loopback={opts['loopback']}",
                      f"\n## Replayed on {view.name}", *tables_of(made, checks, view),
                      "\n### Probes\n\n" + "\n".join(f"- {line}" for line in probes),
                      "\n### Commands\n\n```\n" + "\n".join(batch.commands) + "\n```"])
    print(text)
    (out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
