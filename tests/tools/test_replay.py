"""launch.replay: a saved run replayed on other links, into a directory of its own, without rerunning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launcher import GIVEN_LOOPBACK, TINY, assert_ok, run_train

from parallel.report.breakdown import CATEGORIES


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    # The one run of the suite that probes its loopback itself (the others are given GIVEN_LOOPBACK).
    tiny = [a for a in TINY if a not in GIVEN_LOOPBACK]
    run = run_train(2, [*tiny, "parallel=pp_1f1b", "parallel.microbatches=4", "train.steps=4", "run.timeline=false"],
                    tmp_path_factory.mktemp("replay") / "run")
    assert_ok(run)
    link = run.summary["virtual"]["link_model"]
    assert link["source"].startswith("probed in this run: ranks 0 and 1, each bound to a core"), link
    assert link["intra"]["bytes_per_s"] > 0 and link["intra"]["latency_s"] > 0 and link["intra"]["p2p_latency_s"] > 0
    # Its calls are logged, outside the steps and as tooling: none in the strategy's figures.
    comm = run.summary["comm"]
    assert comm["outside_steps"]["by_tag"]["tooling/probe/payload"]["sent_bytes"] > 0, comm["outside_steps"]
    assert not any(tag.startswith("tooling/") for tag in comm["by_tag"])
    return run


def replay(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.replay", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_replays_write_their_own_directory_and_never_the_runs(pp_run):
    run_dir = pp_run.run_dir
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file()}
    own = json.loads((run_dir / "summary.json").read_text())["virtual"]
    again = replay(run_dir)
    assert again.returncode == 0, again.stderr
    replayed = json.loads((run_dir / "replay-own" / "summary.json").read_text())["virtual"]
    assert replayed["step_times_s"] == own["step_times_s"]  # the same graph on the same links: the same numbers
    assert replay(run_dir).returncode == 0
    assert (run_dir / "replay-own-2" / "trace_virtual.json").exists()  # a second replay: a new directory
    slow = replay(run_dir, "net=ethernet_1g", "net.inter_mbit=200")
    assert slow.returncode == 0, slow.stderr
    out = run_dir / "replay-ethernet_1g-inter_mbit200"
    block = json.loads((out / "summary.json").read_text())["virtual"]
    assert {p.name for p in out.iterdir()} >= {"summary.json", "trace_virtual.json", "timeline_virtual.png"}
    assert block["link_model"]["inter"]["bytes_per_s"] == 200e6 / 8 and block["what_if"] is None
    assert list(block["time_breakdown_s"]) == list(CATEGORIES)
    assert "waits on:" in slow.stdout and "virtual step" in slow.stdout
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file()} == before


def test_a_cluster_replay_scales_compute_and_says_it_is_a_what_if(pp_run):
    result = replay(pp_run.run_dir, "cluster=h100_sxm")
    assert result.returncode == 0, result.stderr
    assert "[WHAT-IF]" in result.stdout
    block = json.loads((pp_run.run_dir / "replay-h100_sxm" / "summary.json").read_text())["virtual"]
    assert block["what_if"].startswith("cluster=h100_sxm") and 0 < block["compute_scale"] < 1
    assert block["link_model"]["intra"]["scope"] == "rank"


def test_processor_sharing_replay_and_refusals(pp_run):
    shared = replay(pp_run.run_dir, "cores=1")
    assert shared.returncode == 0, shared.stderr
    block = json.loads((pp_run.run_dir / "replay-own-cores1" / "summary.json").read_text())["virtual"]
    assert block["cores"] == 1
    # The run's own wall breakdown is printed beside the replay's, from its summary.json.
    wall = json.loads((pp_run.run_dir / "summary.json").read_text())["time_breakdown_s"]
    line = next(x for x in shared.stdout.splitlines() if x.startswith("the run's wall breakdown (mean over ranks): "))
    assert f"compute {wall['compute'] * 1e3:.3g} ms" in line and f"bubble {wall['bubble'] * 1e3:.3g} ms" in line
    wrong = replay(pp_run.run_dir, "net=cluster")  # 2 nodes x 2 ranks, the run has 2
    assert wrong.returncode == 2 and "net.procs_per_node" in wrong.stderr
    assert replay(pp_run.run_dir / "nowhere").returncode == 2
    assert replay(pp_run.run_dir, "colour=blue").returncode == 2


def test_cores_bound_replays_each_rank_on_the_core_the_run_bound_it_to(pp_run, tmp_path):
    # The run's two ranks had a core each (train.pin_cores=auto on 2 cores): its events name them.
    events = [json.loads((pp_run.run_dir / "events" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(events[0]["cores"]) == len(events[1]["cores"]) == 1 and events[0]["cores"] != events[1]["cores"]
    bound = replay(pp_run.run_dir, "cores=bound")
    assert bound.returncode == 0, bound.stderr
    assert "each rank on the core the run bound it to" in bound.stdout
    block = json.loads((pp_run.run_dir / "replay-own-cores_bound" / "summary.json").read_text())["virtual"]
    assert [core for _, core in block["cores"]] == [events[0]["cores"][0], events[1]["cores"][0]]
    assert f"0:{events[0]['cores'][0]}, 1:{events[1]['cores'][0]}" in block["definition"]
    # A rank the run left free to run on two cores: no placement to replay, and the fix is named.
    import shutil
    loose = tmp_path / "loose"
    shutil.copytree(pp_run.run_dir, loose, ignore=shutil.ignore_patterns("replay-*"))
    rank1 = loose / "events" / "rank1.json"
    rank1.write_text(json.dumps({**events[1], "cores": [0, 1]}))
    refused = replay(loose, "cores=bound")
    assert refused.returncode == 2 and "train.pin_cores=round_robin" in refused.stderr
    for bad in ("cores=0", "cores=many"):
        wrong = replay(pp_run.run_dir, bad)
        assert wrong.returncode == 2 and "a number above 0), or bound" in wrong.stderr, wrong.stderr


def test_the_communications_cpu_is_charged_to_the_cores_unless_freed_or_a_cluster_what_if(pp_run, tmp_path):
    own = json.loads((pp_run.run_dir / "summary.json").read_text())["virtual"]
    assert own["communication_cpu_s"] > 0  # the pipeline's messages took some of the ranks' CPU
    free = replay(pp_run.run_dir, "comm_cpu=free")
    assert free.returncode == 0, free.stderr
    block = json.loads((pp_run.run_dir / "replay-own-comm_cpu_free" / "summary.json").read_text())["virtual"]
    assert block["communication_cpu_s"] is None and "none of the ranks' CPU" in block["replay"]
    assert "copy engine" in block["definition"]
    assert "communication's CPU" not in free.stdout and "communication's CPU" in replay(pp_run.run_dir).stdout
    assert replay(pp_run.run_dir, "cluster=h100_sxm", f"out={tmp_path / 'h100'}").returncode == 0
    assert json.loads((tmp_path / "h100" / "summary.json").read_text())["virtual"]["communication_cpu_s"] is None
    bad = replay(pp_run.run_dir, "comm_cpu=maybe")
    assert bad.returncode == 2 and "charged" in bad.stderr and "free" in bad.stderr


def test_a_gpu_runs_own_replay_leaves_the_communications_cpu_out(pp_run, tmp_path):
    # The same saved events as a GPU run would have them: NCCL's host threads take nothing of the
    # device's compute, so its replay charges none of their CPU (the CPU run's charges some).
    from parallel.replay import events
    from parallel.replay.links import LinkModel
    from parallel.report.virtual import write_virtual

    summary = json.loads((pp_run.run_dir / "summary.json").read_text())
    saved = events.load(pp_run.run_dir)
    links = LinkModel.from_dict(summary["virtual"]["link_model"])
    assert write_virtual(tmp_path, saved, summary, links, draw=False)["communication_cpu_s"] > 0
    gpu = {**summary, "device": "cuda"}
    assert write_virtual(tmp_path, saved, gpu, links, draw=False)["communication_cpu_s"] is None


def test_a_contention_replay_on_the_loopback_probed_unbound(pp_run):
    """`loopback=unbound` probes this machine's loopback now with its ranks not bound (as a run
    with more ranks than cores meets it) and replays on it (`probes=1`: one probe run instead of the
    median of three); a bad choice, a bad count, a count without the probe, or a cluster's links, refused."""
    result = replay(pp_run.run_dir, "cores=2", "loopback=unbound", "probes=1")
    assert result.returncode == 0, result.stderr
    block = json.loads((pp_run.run_dir / "replay-own-cores2-loopback_unbound" / "summary.json").read_text())["virtual"]
    own = json.loads((pp_run.run_dir / "summary.json").read_text())["virtual"]["link_model"]
    assert "not bound to cores" in block["link_model"]["source"] and "bound to a core" in own["source"]
    assert block["link_model"]["source"].endswith("two ranks not bound to cores, one probe run"), block["link_model"]
    for count in ("0", "two"):
        bad = replay(pp_run.run_dir, "loopback=unbound", f"probes={count}")
        assert bad.returncode == 2 and f"probes='{count}': how many probe runs" in bad.stderr, bad.stderr
    alone = replay(pp_run.run_dir, "cores=2", "probes=1")
    assert alone.returncode == 2 and "it goes with loopback=unbound" in alone.stderr, alone.stderr
    assert block["link_model"]["intra"]["latency_s"] > 0 and block["cores"] == 2
    bad = replay(pp_run.run_dir, "loopback=pinned")
    assert bad.returncode == 2 and "loopback='pinned': run" in bad.stderr and "unbound" in bad.stderr
    mixed = replay(pp_run.run_dir, "cluster=h100_sxm", "loopback=unbound")
    assert mixed.returncode == 2 and "a cluster's links are the preset's" in mixed.stderr


def test_a_sweep_probes_the_loopback_once_under_a_torchrun_of_its_own():
    """launch.compare's probe (`measure_once`: the probe module under a torchrun of two ranks, the
    figures read back from rank 0's JSON line), here one probe run rather than a sweep's median of
    three; the GPU check's dry run (tools/test_gpu_check.py) gives its compare the figures instead."""
    from parallel.replay.probe import FIGURES, measure_once

    figures = measure_once(runs=1)
    assert sorted(figures) == sorted(FIGURES), figures
    assert all(0 < value < float("inf") for value in figures.values()), figures
