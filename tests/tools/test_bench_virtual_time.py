"""bench/virtual_time, the validation table's bench: its options and its runs made at once.

The bench's checks themselves are timings, never asserted here. What is asserted: a bad option is
refused by name before any run, and repeats started together (the stability check's) are real,
separate runs of the same config, each through parallel/runner.py: each its own directory and
summary, the same losses to the bit, as the same config made twice one after another gives; and
the hold that lines their steps up stops a run, every process of it, until the last run has
written its first step.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import time

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT

from parallel.runner import descendants


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.virtual_time", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **CPU_ONLY})


@pytest.mark.parametrize("args, said", [
    (["loopback=per-run"], "loopback='per-run': sampled or once"),
    (["repeats=1"], "repeats='1': at least 2"),
    (["checks=stability,speed"], "unknown check(s) speed"),
    (["reps=3"], "unknown option 'reps'"),
])
def test_bad_options_are_refused_by_name(args, said, tmp_path):
    result = bench(*args, f"out={tmp_path}")
    assert result.returncode != 0
    assert said in result.stderr
    assert not any(tmp_path.iterdir())  # refused before any run


@pytest.fixture
def runs(monkeypatch):
    """The bench's runs, as a module of the project's folder."""
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))
    return importlib.import_module("bench.virtual_time.runs")


@pytest.fixture
def tables(monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))
    return importlib.import_module("bench.virtual_time.tables")


def test_repeats_started_together_are_separate_runs_of_one_config(tmp_path, monkeypatch, runs):
    for key, value in CPU_ONLY.items():
        monkeypatch.setenv(key, value)

    # The loopback's figures given, as the bench gives its probe to every run: no run probes it.
    given = ["virtual.loopback_gbytes_per_s=1.0", "virtual.loopback_latency_us=200",
             "virtual.loopback_p2p_latency_us=100"]
    batch = runs.Batch(tmp_path, ["model=tiny", "train.steps=2", *given], sampled=False)
    dirs = [tmp_path / f"once-{k}" for k in range(2)]
    summaries = batch.train_together(2, [*batch.common, "parallel=dp"], dirs)
    assert summaries[0]["losses"] == summaries[1]["losses"] and len(summaries[0]["losses"]) == 2
    assert all((d / "summary.json").exists() for d in dirs)
    assert all(s["virtual"]["link_model"]["intra"]["latency_s"] == pytest.approx(200e-6) for s in summaries)
    # Both commands are printed as started in the background, then waited for.
    assert [c.endswith(" &") for c in batch.commands] == [True, True, False]
    assert batch.commands[-1].startswith("wait")
    # Each through the runner: its console kept beside its summary.
    assert all((d / "console.log").read_text().startswith("$ ") for d in dirs)


HOLDER = """
import pathlib, sys, time
out = pathlib.Path(sys.argv[1])
time.sleep(float(sys.argv[2]))
stepped = time.time()
(out / "metrics.jsonl").write_text("{}\\n")
time.sleep(float(sys.argv[3]))  # stopped in here by the hold, if it holds
(out / "times").write_text(f"{stepped} {time.time()}")
"""


def test_the_hold_keeps_each_run_stopped_until_every_run_has_stepped(tmp_path, runs):
    dirs = [tmp_path / "early", tmp_path / "late"]
    for d in dirs:
        d.mkdir()
    # The early run writes its first step at once and would finish 0.3 s later; the late one
    # writes its first step after 1.5 s.
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(d), delay, "0.3"])
             for d, delay in zip(dirs, ("0", "1.5"))]
    try:
        runs.hold_until_all_stepped(procs, dirs, limit_s=60)
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    early_stepped, early_done = map(float, (dirs[0] / "times").read_text().split())
    late_stepped, _ = map(float, (dirs[1] / "times").read_text().split())
    assert early_done >= late_stepped > early_stepped + 1.0


def test_the_processes_held_reach_ranks_in_sessions_of_their_own():
    # The hold stops a run's torchrun and parallel.runner.descendants of it; torchrun starts each
    # rank with start_new_session=True, so a process group would miss them.
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               "'import time; time.sleep(60)'], start_new_session=True)"])
    try:
        for _ in range(500):
            below = descendants(parent.pid)
            if below:
                break
            time.sleep(0.01)
        assert len(below) == 1
        assert os.getsid(below[0]) != os.getsid(parent.pid)
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def test_ranks_are_spread_over_the_cores_by_local_rank(runs):
    cores = sorted(os.sched_getaffinity(0))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ranks = [subprocess.Popen(sleeper, env={**os.environ, "LOCAL_RANK": str(r)}) for r in range(2)]
    other = subprocess.Popen(sleeper, env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    try:
        for _ in range(500):  # until each has exec'd python, whose environment /proc shows
            if all(runs.local_rank_of(p.pid) == r for r, p in enumerate(ranks)):
                break
            time.sleep(0.01)
        runs.spread_ranks_over_cores([p.pid for p in [*ranks, other]], cores)
        assert [os.sched_getaffinity(p.pid) for p in ranks] == [{cores[r % len(cores)]} for r in range(2)]
        assert os.sched_getaffinity(other.pid) == set(cores)  # not a rank: left alone
    finally:
        for p in [*ranks, other]:
            p.kill()
            p.wait()


def test_a_probe_replaces_the_loopback_figures_and_nothing_else(tables):
    from parallel.replay.links import LinkModel, loopback

    own = loopback(1.5e9, 200e-6, "the probe before the batch", p2p_latency_s=120e-6)
    own = LinkModel(own.name, own.intra, own.inter, procs_per_node=4, placement="cyclic", lanes=1)
    probe = {"bytes_per_s": 0.9e9, "latency_s": 310e-6, "p2p_latency_s": 180e-6, "time": "05:06:00"}
    links = tables.on_loopback({"virtual": {"link_model": own.as_dict()}}, probe, "the probe just before")

    assert (links.intra.bytes_per_s, links.intra.latency_s, links.intra.p2p_latency_s) == (0.9e9, 310e-6, 180e-6)
    assert links.source == "the probe just before"
    assert (links.procs_per_node, links.placement, links.lanes, links.intra.scope) == (4, "cyclic", 1, "rank")
    # The view on the batch's median is the same replacement.
    view = tables.View("the median", probe)
    assert view.link({"virtual": {"link_model": own.as_dict()}}) == dataclasses.replace(links, source="the median")
