"""Checks of a run's time breakdown and trace, shared by the strategy tests (whose runs they reuse).

check_time_breakdown: summary.json's five parts are non-negative (no call counted twice, none
outside the phase that made it) and add up to the breakdown step's time (within 5%, the brief's
bound; the phases are stamped by the step's own clock, so it is exact but for float rounding);
that step is the median timed step; every rank is there with its coordinates, its own parts
adding up to the slowest rank's step (its own, plus its wait for the slowest).
check_trace: trace.json is Chrome trace JSON (what Perfetto opens) with one process per rank named
by its global rank and coordinates, and the bytes on each rank's communication spans equal what
the communication log recorded for that rank in the last step, call for call.
Both also check the virtual clock (parallel/replay/): the `virtual` block's five parts add up to
its step on every rank, trace_virtual.json has every rank, and replaying the saved events again
gives the summary's numbers exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel.report.breakdown import CATEGORIES

TOLERANCE = 0.05


def check_time_breakdown(s: dict) -> dict:
    parts, detail, by_rank = s["time_breakdown_s"], s["time_breakdown"], s["time_breakdown_by_rank"]
    assert list(parts) == list(CATEGORIES)
    assert all(v >= 0 for v in parts.values()), parts
    step = detail["step_time_s"]
    assert abs(sum(parts.values()) - step) <= TOLERANCE * step, (parts, step)
    assert sum(parts.values()) == pytest.approx(detail["sum_s"])
    # The breakdown is of the median timed step: with an odd number of timed steps, the summary's step time.
    timed = s["step_times_s"][s["warmup_steps"]:]
    assert step in timed and sorted(timed)[(len(timed) - 1) // 2] == step
    if len(timed) % 2:
        assert step == s["step_time_s"]
    assert [r["rank"] for r in by_rank] == list(range(s["world_size"]))
    assert all("coords" in r and "pp" in r["coords"] for r in by_rank)
    assert sum(parts.values()) == pytest.approx(step, rel=1e-9)
    for r in by_rank:
        assert all(r[c] >= 0 for c in CATEGORIES), r
        assert r["step_s"] <= step and sum(r[c] for c in CATEGORIES) == pytest.approx(step, rel=1e-9)
    compute = detail["compute_s"]
    assert set(compute) >= {"forward", "backward", "recompute"}
    check_virtual_breakdown(s)
    return parts


def check_virtual_breakdown(s: dict) -> dict:
    v = s["virtual"]
    assert v is not None and "error" not in v, v
    assert list(v["time_breakdown_s"]) == list(CATEGORIES)
    step = v["step_time_s"]
    assert step > 0 and step in v["step_times_s"]
    assert [r["rank"] for r in v["time_breakdown_by_rank"]] == list(range(s["world_size"]))
    for r in v["time_breakdown_by_rank"]:
        assert all(r[c] >= -1e-12 for c in CATEGORIES), r
        assert sum(r[c] for c in CATEGORIES) == pytest.approx(step, rel=1e-9)
    assert sum(v["time_breakdown_s"].values()) == pytest.approx(step, rel=1e-9)
    assert v["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / step, rel=1e-12)
    return v


def check_virtual_replay(run_dir: Path, s: dict) -> None:
    """The saved events replayed twice give the summary's virtual numbers, to the last bit."""
    from parallel.dist.binding import allowed_cores
    from parallel.replay import events
    from parallel.replay.links import LinkModel
    from parallel.replay.virtual import replay_run

    v = s["virtual"]
    saved = events.load(run_dir)
    assert [e["rank"] for e in saved] == list(range(s["world_size"]))
    # The other threads' CPU clock is stamped on every phase and span, and goes back by no more
    # than its reads' noise (timing.cpu_stamp): the process clock takes a running thread's time in
    # at the scheduler's tick, so a read can fall short by up to a tick for each thread running
    # then, at most one a core. Allowed: a core's worth of the longest tick Linux builds (10 ms).
    back = 10e-3 * len(allowed_cores())
    for e in saved:
        for step in e["steps"]:
            phases = step["phases"]
            stamps = [x[k] for x in [*phases, *step["spans"]] for k in ("helper_start", "helper_end")]
            assert all(isinstance(v, float) for v in stamps)
            assert all(p["helper_end"] >= p["helper_start"] - back for p in phases)
            assert all(b["helper_start"] >= a["helper_end"] - back for a, b in zip(phases, phases[1:]))
            assert all(x["helper_end"] >= x["helper_start"] - back for x in step["spans"])
    if s["world_size"] > 1 and v["device_per_rank"]["compute_clock"] == "thread_cpu":
        # gloo's threads took some CPU for the step's collectives (a rank of several intra-op threads
        # is replayed on its wall clock, which holds it already: parallel/replay/device.py)
        assert v["communication_cpu_s"] > 0
    else:
        assert v["communication_cpu_s"] is None or s["world_size"] == 1
    links = LinkModel.from_dict(v["link_model"])
    kwargs = dict(tokens_per_step=s["tokens_per_step"], flops_per_token=s["mfu"]["flops_per_token"],
                  peak_per_device=v["mfu"]["peak_flops_per_device"])
    first, _ = replay_run(saved, links, **kwargs)
    second, _ = replay_run(saved, links, **kwargs)
    for block in (first, second):
        assert block["step_times_s"] == v["step_times_s"]
        assert block["time_breakdown_s"] == v["time_breakdown_s"]
    trace = json.loads((run_dir / "trace_virtual.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert pids == set(range(s["world_size"]))


def check_trace(run_dir: Path, s: dict) -> dict:
    check_virtual_replay(run_dir, s)
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"]
    world = s["world_size"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(world))
    coords = {r["rank"]: r["coords"] for r in s["time_breakdown_by_rank"]}
    for rank, name in names.items():
        assert name.startswith(f"rank {rank} (")
        for dim in ("pp", "dp", "tp"):
            if s["parallel"][dim] > 1:
                assert f"{dim} {coords[rank][dim]}" in name, name
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0
        assert e["pid"] in names and e["tid"] in (0, 1, 2)
    assert {e["pid"] for e in spans if e["tid"] == 0} == set(range(world)), "every rank has its phases"
    comm = [e for e in spans if e["tid"] in (1, 2)]
    strategy_comm = [e for e in comm if not e["args"]["tag"].startswith("tooling/")]
    # The bytes on the spans of each rank are the bytes the log recorded for it in the last step.
    for rank in range(world):
        sent = sum(e["args"]["sent_bytes"] for e in strategy_comm if e["pid"] == rank)
        assert sent == pytest.approx(s["comm"]["by_rank"][rank], rel=1e-12, abs=1e-6), rank
    calls = [e for e in strategy_comm if e["args"]["kind"] != "wait"]
    assert len(calls) == s["comm"]["calls_per_step"]
    assert sum(e["args"]["payload_bytes"] for e in calls) == s["comm"]["payload_bytes_per_step"]
    assert all(e["args"]["payload_bytes"] == 0 for e in comm if e["args"]["kind"] == "wait")
    assert s["trace"]["trace"] == "trace.json" and s["trace"]["step"] == s["first_step"] + len(s["losses"]) - 1
    return trace
