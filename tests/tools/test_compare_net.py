"""launch.compare on networks, as a user runs it: the sweep once per network and the crossover
(parallel/compare/networks.py, crossover.py), and the refusal of a world the network cannot run.

The sweep is the smallest that proves the point: dp and pp_1f1b on the tiny model, 4 steps, on
this machine's loopback and on 2 emulated nodes at 200 Mbit/s (4 runs, 2 of them through
launch.run; ~50 s of 2 idle cores). The refusals start no run (a few seconds each).
"""

import csv
import json
import os
import subprocess
import sys

from launcher import CPU_ONLY, GIVEN_LOOPBACK, PROJECT_ROOT
from net_launcher import require_network

from parallel.compare.rows import COLUMNS
from parallel.net.netns import our_namespaces

SLOW = "{preset:ethernet_1g,inter_mbit:200,label:slow}"


def _compare(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.compare", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **CPU_ONLY})


def test_sweep_per_network_and_the_crossover(tmp_path):
    require_network()
    out = tmp_path / "sweep"
    proc = _compare([f"compare.nets=[none,{SLOW}]", "compare.world=2", "compare.strategies=[dp,pp_1f1b]",
                     "model=tiny", "train.steps=4", "train.warmup_steps=1", "data.max_bytes=1000000",
                     "compare.peak_flops=1e11", *GIVEN_LOOPBACK, f"run.dir={out}"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not our_namespaces(), "a network of the sweep was left behind"

    # One row per strategy per network, the network a column; each network's own complete sweep beside.
    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        assert [(r["network"], r["strategy"]) for r in reader] == [
            ("none", "dp"), ("none", "pp_1f1b"), ("slow", "dp"), ("slow", "pp_1f1b")]
    rows = {(r["network"], r["strategy"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    for name in ("none", "slow"):
        assert (out / name / "report.md").exists() and (out / name / "results.csv").exists()
    assert (out / "crossover.png").stat().st_size > 0

    for strategy in ("dp", "pp_1f1b"):
        loopback, slow = rows[("none", strategy)], rows[("slow", strategy)]
        assert loopback["status"] == slow["status"] == "ok"
        # The same model on either network, and the same logged bytes, equal to theory.
        assert slow["final_loss"] == loopback["final_loss"]
        assert slow["bytes_per_step"] == loopback["bytes_per_step"] and slow["matches_theory"]
        assert (loopback["world"], loopback["nodes"], loopback["inter_mbit"]) == (2, 1, None)
        assert loopback["inter_wire_bytes_per_step"] is None  # the host's interfaces are not read
        assert (slow["world"], slow["nodes"], slow["procs_per_node"], slow["inter_mbit"]) == (2, 2, 1, 200.0)
        # The emulated link's counters saw what the log predicts, and the link's busy time is bytes / rate.
        wire, logged = slow["inter_wire_bytes_per_step"], slow["inter_logged_bytes_per_step"]
        assert abs(wire - logged) <= 0.03 * logged, (wire, logged)
        assert slow["inter_link_busy_ms"] >= wire / 2 * 8 / 200e6 * 1e3 * 0.99  # the busier node, at 200 Mbit/s

    # Per network: the best layout is the faster row, and every other row says what it waits on.
    report = (out / "report.md").read_text()
    assert "![tokens/s against the inter-node bandwidth](crossover.png)" in report
    for name in ("none", "slow"):
        best = max(("dp", "pp_1f1b"), key=lambda s: rows[(name, s)]["tokens_per_s"])
        other = "pp_1f1b" if best == "dp" else "dp"
        block = report.split(f"**{name}** (")[1].split("Full report")[0]
        assert f"the best layout is **{best}** ({rows[(name, best)]['layout']})" in block, block
        assert f"| {best} |" in block and "| fastest |" in block
        waits = next(line for line in block.splitlines() if line.startswith(f"| {other} |")).split(" | ")[-1]
        assert waits.startswith(("communication", "the pipeline bubble", "mostly computes")), block
    assert "200 Mbit/s between nodes" in report


def _refused(args: list[str]) -> str:
    proc = _compare([*args, "model=tiny", "compare.peak_flops=1e11"], timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_a_world_the_network_cannot_run_is_refused(tmp_path):
    """Before any run (no privileges needed: the check comes first)."""
    line = _refused(["net=ethernet_1g", "compare.world=4", f"run.dir={tmp_path / 'a'}"])
    assert line == ("error: compare.world=4 does not match the network: net=ethernet_1g runs 2 nodes x 1 = 2 "
                    "processes, and on an emulated network every run has its world; leave compare.world out (it is "
                    "derived) or change net.nodes / net.procs_per_node")
    line = _refused([f"compare.nets=[none,{SLOW}]", "+compare.worlds.tp=4", "compare.strategies=[dp,tp]",
                     f"run.dir={tmp_path / 'b'}"])
    assert line.startswith("error: compare.worlds.tp=4 does not match the network: net=slow runs 2 nodes x 1 = 2"), line
    assert not (tmp_path / "a" / "results.csv").exists() and not (tmp_path / "b" / "none").exists()


def test_a_sweep_that_would_time_no_diloco_sync_is_refused(tmp_path):
    """DiLoCo at H = 50 in a sweep of 20 steps: refused before anything runs, with the steps that fit
    (parallel/compare/fits.py; HSDP's skips on a network of 2 ranks are its unit test's)."""
    line = _refused(["compare.strategies=[dp,diloco_h50]", "train.steps=20", f"run.dir={tmp_path / 'a'}"])
    assert line.startswith("error: diloco_h50 syncs every parallel.inner_steps=50 steps, but the runs time 17 "), line
    assert "give train.steps=53 or more" in line and not (tmp_path / "a").exists()


def test_the_world_of_each_run_and_the_network_labels():
    """In one process: how a sweep's networks are read and which world each strategy runs at."""
    from omegaconf import OmegaConf

    from launch.config import CONFIG_DIR
    from parallel.compare.networks import explicit_keys, from_entry, strategy_world

    compare = OmegaConf.create({"world": 4, "worlds": {"single": 1, "3d": 8}})
    loopback, cluster = from_entry(CONFIG_DIR, "none", 4), from_entry(CONFIG_DIR, "cluster", 4)
    slow = from_entry(CONFIG_DIR, {"preset": "cluster", "inter_mbit": 200, "placement": "cyclic"}, 4)
    # net=none is today's sweep: compare.world and its exceptions.
    assert [strategy_world(s, compare, loopback) for s in ("single", "dp", "3d")] == [1, 4, 8]
    # On a network the network's world, but one process stays one process (no links).
    assert [strategy_world(s, compare, cluster) for s in ("single", "dp", "3d")] == [1, 4, 4]
    assert (slow.label, slow.world, slow.spec.node_of_rank(1), slow.dir_name) == (
        "cluster(inter_mbit=200, placement=cyclic)", 4, 1, "cluster-inter_mbit-200-placement-cyclic")
    overrides = slow.launch_overrides()
    assert overrides[:2] == ["net=cluster", "net.nodes=2"] and "net.inter_mbit=200" in overrides
    # A none entry may carry its own world; a label names an entry.
    own = from_entry(CONFIG_DIR, {"preset": "none", "procs_per_node": 2, "label": "w2"}, 4)
    assert (own.label, own.world, own.emulated) == ("w2", 2, False)
    assert explicit_keys(["compare.world=2", "+compare.worlds.tp=4", "model=tiny"]) == (True, {"tp"}, False)
    assert explicit_keys(["net=cluster", "compare.worlds={dp:2}"]) == (False, {"*"}, True)


def test_the_best_layout_is_one_over_ranks_not_the_one_process_reference():
    """On 2 cores a one-process run can outrun every layout of 4 ranks; it touches no link, so it is
    the reference in the verdict, never the network's best layout (unless nothing else ran)."""
    from launch.config import CONFIG_DIR
    from parallel.compare.crossover import tokens_table
    from parallel.compare.networks import from_entry, network_verdict

    def row(strategy, world, tokens):
        return {"strategy": strategy, "world": world, "status": "ok", "tokens_per_s": tokens, "layout": f"w{world}",
                "step_ms": 1000.0, "compute_ms": 500.0, "exposed_comm_ms": 400.0, "bubble_ms": 0.0,
                "inter_wire_bytes_per_step": None, "inter_link_busy_ms": None, "intra_wire_bytes_per_step": None,
                "intra_link_busy_ms": None}

    cluster = from_entry(CONFIG_DIR, "cluster", 4)
    rows = [row("single", 1, 4000.0), row("pp_1f1b", 4, 2700.0), row("dp", 4, 900.0)]
    text = "\n".join(network_verdict(cluster, rows, {}))
    assert "the best layout is **pp_1f1b** (w4)" in text, text
    assert "| single | 4000 |" in text and "one process, no links (the reference)" in text
    assert "| pp_1f1b | **2700** |" in tokens_table([(cluster, rows)])
    # Led by virtual time, each cell gives the wall clock's figure beside it, and the table says so.
    virtual = [{**r, "clock": "virtual", "wall_tokens_per_s": r["tokens_per_s"] / 3} for r in rows]
    table = tokens_table([(cluster, virtual)])
    assert "| pp_1f1b | **2700** / 900 wall |" in table and "in virtual time" in table
    alone = "\n".join(network_verdict(cluster, [row("single", 1, 4000.0)], {}))
    assert "the best layout is **single**" in alone
