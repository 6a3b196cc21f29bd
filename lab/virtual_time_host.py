"""What of the virtual-time validation's spread belongs to this host: the comparisons beside its claims.

    python -m lab.virtual_time_host [checks=apart,unbound,op_cpu,pipelines] [model=tiny] [steps=8]
                                    [repeats=3] [rounds=5] [probes=5] [out=runs/virtual-host]

An investigation of one host, not part of the product: it makes the runs of bench/virtual_time
(through its Batch, a probe run before each) and prints what the validation once printed beside
its claims, to see where a miss came from:

  apart      the stability repeats made one after another beside the same repeats started
             together, with the host alone: one window of lab/host_speed.py's fixed one-thread
             work timed just before each run, or each set made at once
  unbound    the contention runs left where the kernel puts them (`train.pin_cores=off`),
             replayed on a pool of the machine's cores: on the batch's median probe, on the
             loopback probed unbound, and on the probe taken just before each run
  op_cpu     what one call's CPU is beside the op's run median (the engine's figure): the calls'
             CPU quantiles unloaded, loaded and at world 2, and the virtual step replayed both ways
  pipelines  the simulator given one mean F, B, W, then with the messages' costs, then each
             stage's own, against the virtual bubble

Prints the tables and writes them to <out>/table.md.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench import harness
from bench.harness import lower_median, max_dev
from bench.virtual_time import runs, tables
from lab.host_speed import Workload
from parallel.pp.simulator import simulate_schedule, split_costs
from parallel.replay import events as saved
from parallel.replay import graph
from parallel.replay.probe import figure_overrides, link_of, measure_once, median_figures
from parallel.replay.virtual import replay_step, replay_steps
from parallel.report.mfu import usable_cores

CHECKS = ("apart", "unbound", "op_cpu", "pipelines")
OPTIONS = {"checks": ",".join(CHECKS), "model": "tiny", "steps": "8", "repeats": "3", "rounds": "5", "probes": "5",
           "out": "runs/virtual-host"}
HOST_WINDOW_STEPS = 30  # lab/host_speed.py's default window


class HostBatch(runs.Batch):
    """bench/virtual_time's Batch, and before each run (or set made at once) one window of the host alone."""

    def __init__(self, out: Path, common: list[str]):
        super().__init__(out, common, sampled=True)
        self.host = Workload()
        self.host_cpu: dict[str, float] = {}  # run directory's name -> CPU seconds a step of the window

    def before(self, run_dirs: list[Path]) -> None:
        super().before(run_dirs)
        host = self.host.window(HOST_WINDOW_STEPS)[0]
        for d in run_dirs:
            self.host_cpu[d.name] = host


def apart(together: dict, one_by_one: dict, view: tables.View, host_cpu: dict[str, float]) -> str:
    """Each strategy's repeats made one after another, with the host alone beside, against the same
    repeats started together."""
    rows = []
    for strategy, summaries in one_by_one.items():
        v = [view.virtual(d, s)["tokens_per_s"] for d, s in summaries]
        w = [s["tokens_per_s"] for _, s in summaries]
        h = [host_cpu[d.name] for d, _ in summaries]
        v0 = [view.virtual(d, s)["tokens_per_s"] for d, s in together[strategy]]
        h0 = [host_cpu[d.name] for d, _ in together[strategy][:1]]
        rows.append([strategy, " / ".join(f"{x:.0f}" for x in v), f"±{max_dev(v):.1%}", f"±{max_dev(w):.1%}",
                     " / ".join(f"{x * 1e3:.2f}" for x in h), f"±{max_dev(h):.1%}", f"±{max_dev(v0):.1%}",
                     f"{h0[0] * 1e3:.2f}"])
    return tables.table("Repeats made one after another (world 4, tokens/s; the host alone: CPU ms a step of the "
                        "one-thread window just before each run)",
                        ["strategy", "virtual", "max dev.", "wall max dev.", "the host alone", "max dev.",
                         "virtual max dev., started together", "the host alone before them"], rows)


def unbound(runs_: dict, view: tables.View, probed_unbound, nearest: dict[str, dict]) -> str:
    """Unbound world-4 runs replayed with their ranks sharing a pool of the cores: on the view's link,
    on the loopback probed unbound, and on the probe taken just before each run."""
    cores = usable_cores()
    rows = []
    for strategy, summaries in runs_.items():
        walls = [s["step_time_s"] for _, s in summaries]
        links = {"view": [view.link(s) for _, s in summaries], "unbound": [probed_unbound] * len(summaries),
                 "nearest": [tables.on_loopback(s, nearest[d.name], "the probe just before") for d, s in summaries]}
        cells = [" / ".join(f"{tables.replayed(d, s, cores=cores, links=link) / w - 1:+.1%}"
                            for (d, s), link, w in zip(summaries, each, walls)) for each in links.values()]
        rows.append([strategy, " / ".join(f"{w * 1e3:.1f}" for w in walls), *cells])
    return tables.table(f"Contention, unbound: world-4 runs the kernel placed, replayed on a pool of {cores} cores "
                        "(replayed/wall-1)",
                        ["strategy", "wall ms", "on the view's link", "on the loopback probed unbound",
                         "on the probe just before the run"], rows)


def call_quantiles(runs_: list) -> str:
    """Every call's CPU on every member over the runs' timed steps: median / 90th / 99th pct. (ms)."""
    calls = sorted(c for d, _ in runs_ for op in (graph.op_cpu_samples(saved.load(d)) or {}).values() for c in op)
    if not calls:
        return "not measured"
    return " / ".join(f"{calls[min(len(calls) - 1, int(q * len(calls)))] * 1e3:.2f}" for q in (0.5, 0.9, 0.99))


def replayed_ms(runs_: list, view: tables.View, own_calls: bool) -> str:
    """The median over the runs of their lower-median virtual step: each op its run's lower median
    (what the engine does), or each call its own CPU."""
    out = []
    for d, s in runs_:
        events, links = saved.load(d), view.link(s)
        results = ([replay_step(events, i, links) for i in range(len(events[0]["steps"]))] if own_calls
                   else replay_steps(events, links))
        out.append(lower_median([r.step_s for r in results]))
    return f"{statistics.median(out) * 1e3:.1f}"


def op_cpu(unloaded: dict, loaded: dict, core_each: dict, view: tables.View) -> str:
    rows = [[strategy, call_quantiles(unloaded[strategy]), call_quantiles(loaded[strategy]),
             call_quantiles(core_each[strategy]),
             f"{replayed_ms(unloaded[strategy], view, False)} / {replayed_ms(loaded[strategy], view, False)}",
             f"{replayed_ms(unloaded[strategy], view, True)} / {replayed_ms(loaded[strategy], view, True)}"]
            for strategy in unloaded]
    return tables.table("What an op's CPU is: one call's against the run's median (ms)",
                        ["strategy", "a call's CPU at world 4: median / 90th / 99th pct.", "the same, loaded",
                         "the same at world 2, a core per rank", "virtual step, unloaded / loaded (the engine)",
                         "the same with each call's own CPU"], rows)


def pipelines(runs_: dict, view: tables.View) -> str:
    """The simulator's bubble three ways beside the virtual one: one mean F, B, W; with the messages'
    costs; with each stage's own F, B, W and the messages (the validation's claim)."""
    rows = []
    for preset, run in runs_.items():
        if isinstance(run, str):
            continue
        d, s = run
        schedule = runs.PIPELINES[preset]
        v = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
        vpipe, posting, transfer = tables.pipeline_costs(d, s, view)
        f, b, w = (vpipe[k] * v for k in ("mean_forward_s", "mean_backward_s", "mean_weight_s"))
        ways = [split_costs(f, b, w), split_costs(f, b, w, posting, transfer),
                tables.stage_costs(vpipe, v, w > 0, posting, transfer)]
        sims = [simulate_schedule(schedule, 4, 8, v, cost).bubble_fraction for cost in ways]
        bubble = vpipe["bubble"]
        rows.append([preset, f"{bubble:.1%}", *(f"{x:.1%} ({(bubble - x) * 100:+.1f})" for x in sims)])
    return tables.table("Pipelines: p 4, m 8, the simulator three ways (bubble; points under the virtual one)",
                        ["preset", "virtual", "one mean F, B, W", "and the messages",
                         "each stage's own and the messages"], rows)


def main(argv: list[str]) -> None:
    opts = harness.options(argv, OPTIONS)
    checks = opts["checks"].split(",")
    if set(checks) - set(CHECKS):
        raise SystemExit(f"checks={opts['checks']!r}: any of {', '.join(CHECKS)}")
    out = Path(opts["out"]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    batch = HostBatch(out, [f"model={opts['model']}", f"train.steps={opts['steps']}"])
    batch.common += figure_overrides(measure_once(int(opts["probes"])))
    print("\n".join(report(batch, checks, int(opts["repeats"]), int(opts["rounds"]), int(opts["probes"]))))


def report(batch: HostBatch, checks: list[str], count: int, rounds: int, probes: int) -> list[str]:
    together = runs.repeats(batch, count, "w4once") if {"apart", "op_cpu"} & set(checks) else {}
    one_by_one = runs.repeats(batch, count, "w4", together=False) if {"apart", "unbound"} & set(checks) else {}
    loaded = runs.loaded_repeats(batch, count)[0] if "op_cpu" in checks else {}
    core_each = runs.faithful_runs(batch, rounds) if "op_cpu" in checks else {}
    piped = runs.pipeline_runs(batch) if "pipelines" in checks else {}
    probed_unbound = (link_of(measure_once(probes, pin_cores="off"), "probed unbound (pin_cores=off)")
                      if "unbound" in checks else None)
    view = tables.View(f"the median of {len(batch.samples)} probes across the batch", median_figures(batch.samples))
    parts = [f"# what of virtual time's spread is this host's: replayed on {view.name}"]
    if "apart" in checks:
        parts.append(apart(together, one_by_one, view, batch.host_cpu))
    if "unbound" in checks:
        parts.append(unbound(one_by_one, view, probed_unbound, {x["before"]: x for x in batch.samples}))
    if "op_cpu" in checks:
        parts.append(op_cpu(together, loaded, core_each, view))
    if "pipelines" in checks:
        parts.append(pipelines(piped, view))
    (batch.out / "table.md").write_text("\n".join(parts) + "\n")
    return parts


if __name__ == "__main__":
    main(sys.argv[1:])
