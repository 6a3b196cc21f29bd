"""docs/network.md's table: each strategy on each network, one launch.run job each (needs root).

    python -m bench.net_table                                    # model=small, 6 steps
    python -m bench.net_table model=tiny train.steps=6 nets=none,ethernet_1g strategies=dp,tp
    python -m bench.net_table render                             # the table again, from the last runs

Prints one markdown row per (network, strategy): tokens/s, exposed communication per step, how long
each node's link is busy a step (its share of the inter-node wire bytes at the link's rate), and the
inter-node (and shaped intra-node) bytes per step the interface counters saw against what the
communication log predicts (parallel/net/predict.py). Each job runs through bench/harness.py (parallel/runner.py);
run directories go to runs/net_table/<net>-<strategy>; `render` re-prints the table from them without running
anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import harness

OUT = Path("runs") / "net_table"
# name -> launch.run overrides; "200mbit" is ethernet_1g slowed to 200 Mbit/s (the measurement).
NETS = {
    "none": ["net=none"],
    "ethernet_1g": ["net=ethernet_1g"],
    "200mbit": ["net=ethernet_1g", "net.inter_mbit=200"],
    "cluster": ["net=cluster"],
    "h100": ["net=h100"],
}
STRATEGIES = ["dp", "tp", "pp_1f1b", "zero2"]


def _arguments(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    nets, strategies, overrides = list(NETS), STRATEGIES, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "nets":
            nets = value.split(",")
        elif key == "strategies":
            strategies = value.split(",")
        else:
            overrides.append(arg)
    return nets, strategies, overrides or ["model=small", "train.steps=6", "train.warmup_steps=2"]


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def row(net: str, strategy: str, summary: dict) -> str:
    n = summary["net"]
    s = n["settings"]
    layout = f"{s['nodes']} x {s['procs_per_node']}"
    comm = summary["comm"]
    inter = n["by_link_class"]["inter"]
    # How long each node's link is busy a step: its share of the wire bytes at the link's rate.
    busy = (f"{inter['wire_bytes_per_step'] / s['nodes'] * 8 / (s['inter_mbit'] * 1e6) * 1e3:.0f} ms"
            if s["inter_mbit"] and inter["wire_bytes_per_step"] is not None else "-")
    intra = n["by_link_class"]["intra"]
    ratio = "-" if inter["wire_over_logged"] is None else f"{inter['wire_over_logged']:.3f}"
    shaped_intra = intra["wire_over_logged"] is not None and s["intra_mbit"] is not None
    intra_ratio = f"{intra['wire_over_logged']:.3f}" if shaped_intra else "-"
    exposed = f"{comm['exposed_seconds_per_step'] * 1e3:.0f} ms"
    return (f"| {net} | {layout} | {strategy} | {summary['tokens_per_s']:.0f} | {exposed} "
            f"| {busy} | {_mb(inter['wire_bytes_per_step'])} | {_mb(inter['logged_bytes_per_step'])} | {ratio} "
            f"| {intra_ratio} |")


def main(argv: list[str]) -> None:
    render = "render" in argv
    nets, strategies, overrides = _arguments([a for a in argv if a != "render"])
    print("| net | nodes x ranks | strategy | tokens/s | exposed comm / step | inter link busy / step "
          "| inter MB/step wire | inter MB/step logged | wire / logged | intra wire / logged |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for net in nets:
        for strategy in strategies:
            run_dir = (OUT / f"{net}-{strategy}").resolve()
            try:
                summary = (json.loads((run_dir / "summary.json").read_text()) if render else
                           harness.run(harness.net_command([*NETS[net], f"parallel={strategy}", *overrides], run_dir),
                                       run_dir))
            except (harness.RunFailed, FileNotFoundError) as e:
                print(f"| {net} | | {strategy} | failed: {e} |", flush=True)
                continue
            print(row(net, strategy, summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
