"""The validation's tables: each check's runs, replayed on a view's loopback figures, against its claim."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from bench.harness import lower_median, max_dev
from bench.virtual_time.runs import PIPELINES
from parallel.pp.simulator import simulate_schedule, split_costs
from parallel.replay import events as saved
from parallel.replay.links import LinkModel, from_net
from parallel.replay.virtual import replay_run, replay_steps
from parallel.report.mfu import usable_cores


class View:
    """The loopback figures a table's virtual figures stand on: each run's own (`figures` None:
    what its summary.json holds), or one set for every run (each run replayed again from its
    saved events on them)."""

    def __init__(self, name: str, figures: dict | None = None):
        self.name, self.figures = name, figures
        self._blocks: dict[Path, dict] = {}

    def link(self, summary: dict) -> LinkModel:
        if self.figures is None:
            return LinkModel.from_dict(summary["virtual"]["link_model"])
        return on_loopback(summary, self.figures, self.name)

    def virtual(self, run_dir: Path, summary: dict) -> dict:
        """The run's `virtual` block on this view's figures."""
        if self.figures is None:
            return summary["virtual"]
        if run_dir not in self._blocks:
            tokens = round(summary["virtual"]["tokens_per_s"] * summary["virtual"]["step_time_s"])
            self._blocks[run_dir] = replay_run(saved.load(run_dir), self.link(summary), tokens_per_step=tokens,
                                               flops_per_token=0.0, peak_per_device=0.0)[0]
        return self._blocks[run_dir]


def on_loopback(summary: dict, figures: dict, source: str) -> LinkModel:
    """The run's own link model with the loopback's three figures replaced by `figures` (a
    probe's): placement, lanes and scope stay the run's."""
    own = LinkModel.from_dict(summary["virtual"]["link_model"])
    intra = dataclasses.replace(own.intra, bytes_per_s=figures["bytes_per_s"], latency_s=figures["latency_s"],
                                p2p_latency_s=figures["p2p_latency_s"])
    return dataclasses.replace(own, intra=intra, source=source)


def replayed(run_dir: Path, summary: dict, cores: float | str | None = None, links: LinkModel | None = None) -> float:
    """The lower-median replayed step of a run's saved events (cores: processor sharing of that
    many; "bound": each rank on the core the run bound it to)."""
    events = saved.load(run_dir)
    if cores == "bound":
        cores = saved.placement(events)
        if cores is None:
            raise SystemExit(f"{run_dir}: its ranks were not each bound to one core (train.pin_cores=round_robin)")
    links = links or LinkModel.from_dict(summary["virtual"]["link_model"])
    return lower_median([r.step_s for r in replay_steps(events, links, cores)])


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"\n### {title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stability(runs: dict, view: View, title: str, base: dict | None = None) -> str:
    """Each strategy's repeats: virtual and wall tokens/s, each with its largest deviation from its
    median (the claim: virtual within ±5%). `base`: the same repeats made without the load, whose
    medians these are set against."""
    rows = []
    for strategy, summaries in runs.items():
        v = [view.virtual(d, s)["tokens_per_s"] for d, s in summaries]
        w = [s["tokens_per_s"] for _, s in summaries]
        rows.append([strategy, " / ".join(f"{x:.0f}" for x in v), f"±{max_dev(v):.1%}",
                     " / ".join(f"{x:.0f}" for x in w), f"±{max_dev(w):.1%}"])
        if base and strategy in base:
            v0 = statistics.median(view.virtual(d, s)["tokens_per_s"] for d, s in base[strategy])
            w0 = statistics.median(s["tokens_per_s"] for _, s in base[strategy])
            rows[-1].append(f"{statistics.median(v) / v0 - 1:+.1%} / {statistics.median(w) / w0 - 1:+.1%}")
    count = len(next(iter(runs.values())))
    return table(f"{title}: world 4, {count} repeats started together (tokens/s)",
                 ["strategy", "virtual", "max dev. from median", "wall", "max dev. from median"]
                 + (["median against the repeats without the load: virtual / wall"] if base else []), rows)


def faithful(runs: dict, view: View) -> str:
    """Per strategy the median virtual and wall steps and the median of the per-run ratios (the
    claim: within 5%), with their range."""
    rows = []
    for strategy, summaries in runs.items():
        v = [view.virtual(d, s)["step_time_s"] for d, s in summaries]
        w = [s["step_time_s"] for _, s in summaries]
        ratios = [a / b - 1 for a, b in zip(v, w)]
        rows.append([strategy, f"{statistics.median(v) * 1e3:.1f}", f"{statistics.median(w) * 1e3:.1f}",
                     f"{statistics.median(ratios):+.1%}", f"{min(ratios):+.1%} to {max(ratios):+.1%}"])
    rounds = len(next(iter(runs.values())))
    return table(f"Faithfulness: world 2, a core per rank, {rounds} rounds (step ms, medians)",
                 ["strategy", "virtual", "wall", "virtual/wall-1 (median of runs)", "range"], rows)


def contention(runs: dict, view: View) -> str:
    """Every world-4 run made with `train.pin_cores=round_robin` (rank i on core i mod the cores)
    replayed with each rank on the core it was bound to, each core shared by its ranks and their
    ops' measured CPU (processor sharing: parallel/replay/engine.py), on the view's link: against
    the run's wall step (the claim: within 10%)."""
    rows = []
    for strategy, summaries in runs.items():
        walls = [s["step_time_s"] for _, s in summaries]
        placed = [replayed(d, s, cores="bound", links=view.link(s)) for d, s in summaries]
        ratios = [x / w - 1 for x, w in zip(placed, walls)]
        rows.append([strategy, " / ".join(f"{w * 1e3:.1f}" for w in walls),
                     " / ".join(f"{x * 1e3:.1f} ({r:+.1%})" for x, r in zip(placed, ratios)),
                     f"{statistics.median(ratios):+.1%}"])
    return table(f"Contention: world-4 runs bound round-robin to {usable_cores()} cores, replayed with each rank on "
                 "its core (step ms)",
                 ["strategy", "wall", "replayed, each core shared by its ranks (replayed/wall-1)",
                  "median of runs"], rows)


def pipeline_costs(run_dir: Path, summary: dict, view: View) -> tuple[dict, float, float]:
    """The virtual pipeline block of the run's replayed step, the CPU time of posting one send or
    receive, and one message's time on the view's link (its latency and an activation's bytes)."""
    block = view.virtual(run_dir, summary)
    vpipe = block["pipeline"]
    index = block["step_times_s"].index(block["step_time_s"])
    events = saved.load(run_dir)
    p2p = [p for e in events if e["rank"] in vpipe["ranks"] for p in e["steps"][index]["phases"]
           if p["phase"] == "p2p" and p["label"] != "wait sends"]
    posting = sum(p["cpu_end"] - p["cpu_start"] for p in p2p) / max(sum(len(p["label"].split()) for p in p2p), 1)
    sends = [sp["payload_bytes"] for e in events for sp in e["steps"][index]["spans"] if sp["op"] == "send"]
    intra = view.link(summary).intra
    transfer = intra.message_latency_s + sum(sends) / max(len(sends), 1) / intra.bytes_per_s
    return vpipe, posting, transfer


def stage_costs(vpipe: dict, v: int, split: bool, comm: float, transfer: float) -> dict:
    """(pipeline stage, chunk) -> Costs from the replayed step's own F, B and W of each stage: the
    stages differ (the first's input gradient stops at the embedding), which one mean per action
    cannot hold. Each as a whole share's (a chunk's times v)."""
    return {tuple(int(x) for x in key.split(".")): split_costs(m["F"] * v, m["B"] * v, m["W"] * v if split else 0.0,
                                                              comm, transfer)
            for key, m in vpipe["by_stage_s"].items()}


def pipelines(runs: dict, view: View) -> str:
    """Each schedule's virtual bubble against the simulator given each stage's measured F, B, W and
    the messages' costs (the claim: within 3 points), with the wall clock's bubble beside."""
    rows = []
    for preset, run in runs.items():
        if isinstance(run, str):
            rows.append([preset, "failed", run, "", ""])
            continue
        d, s = run
        schedule = PIPELINES[preset]
        v = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
        vpipe, posting, transfer = pipeline_costs(d, s, view)
        split = vpipe["mean_weight_s"] > 0
        sim = simulate_schedule(schedule, 4, 8, v, stage_costs(vpipe, v, split, posting, transfer))
        bubble, simulated = vpipe["bubble"], sim.bubble_fraction
        rows.append([preset, f"{bubble:.1%}", f"{simulated:.1%}", f"{(bubble - simulated) * 100:+.1f}",
                     f"{s['pipeline']['bubble_measured']:.1%}"])
    return table("Pipelines: p 4, m 8 (bubble)",
                 ["preset", "virtual", "simulator (each stage's own F, B, W, and the messages)", "points",
                  "wall (measured)"], rows)


def span_ms(steps: list[float]) -> str:
    """Steps in ms: the median (the range)."""
    return f"{statistics.median(steps) * 1e3:.1f} ({min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f})"


def network(pairs: dict, view: View) -> str:
    """Each pair's loopback run replayed onto 200 Mbit/s between 2 nodes, against the pair's run
    on that emulated network: the median of the pairs' ratios (the claim: within 10%), their range,
    and the medians of both sides."""
    rows = []
    for strategy, runs in pairs.items():
        if isinstance(runs, str):
            rows.append([strategy, "", "failed", runs, ""])
            continue
        predicted, measured = [], []
        for (d, s), step in runs:
            links = from_net({"name": "ethernet_1g", "nodes": 2, "procs_per_node": 1, "inter_mbit": 200}, view.link(s))
            predicted.append(replayed(d, s, links=links))
            measured.append(step)
        ratios = [p / m - 1 for p, m in zip(predicted, measured)]
        rows.append([strategy, span_ms(predicted), span_ms(measured),
                     f"{statistics.median(ratios):+.1%}", f"{min(ratios):+.1%} to {max(ratios):+.1%}"])
    rounds = max((len(r) for r in pairs.values() if not isinstance(r, str)), default=0)
    return table(f"Network what-if: {rounds} pairs each, a loopback run at world 2 replayed onto 200 Mbit/s between "
                 "2 nodes against launch.run on it made just after (step ms, medians and ranges)",
                 ["strategy", "replayed", "launch.run measured", "replayed/measured-1 (median of pairs)", "range"],
                 rows)


def said(figures: dict) -> str:
    """A probe's figures (`measure_once`'s keys) in words."""
    return (f"{figures['bytes_per_s'] / 1e9:.2f} GB/s, {figures['latency_s'] * 1e6:.0f} µs per ring step, "
            f"{figures['p2p_latency_s'] * 1e6:.0f} µs per message")


def spread(samples: list[dict]) -> str:
    """The range of a batch's probe samples, each figure's lowest and highest."""
    def span(key: str, scale: float, unit: str, digits: int) -> str:
        values = [s[key] * scale for s in samples]
        return f"{min(values):.{digits}f}-{max(values):.{digits}f} {unit}"
    return ", ".join([span("bytes_per_s", 1e-9, "GB/s", 2), span("latency_s", 1e6, "µs per ring step", 0),
                      span("p2p_latency_s", 1e6, "µs per message", 0)])
