"""A rank's virtual device (parallel/replay/device.py) on synthetic saved steps with known answers:
a rank of one intra-op thread is replayed on its compute thread's CPU time (one core); a rank of
several on its wall stamps (its cores), never on the CPU its threads summed, its calls timed by the
link model as anyone's; the virtual block says which, and its MFU divides by the rank's cores."""

from __future__ import annotations

import pytest

from parallel.replay.links import loopback
from parallel.replay.virtual import replay_run, replay_steps

LINKS = loopback(1e9, 1e-4)


def _stamps(start, end, cpu, helper=True):
    record = {"start": start, "end": end, "cpu_start": cpu[0], "cpu_end": cpu[1]}
    if helper:
        record.update(helper_start=0.0, helper_end=0.0)
    return record


def alone_step() -> dict:
    """A step of 1 s of wall time whose CPU clock read 1.9 s: what two threads' CPU summed to."""
    return {"step": 3, "wall_s": 1.0, "cpu_s": 1.9,
            "phases": [{"phase": "forward", "label": "", **_stamps(0.0, 0.4, (0.0, 0.7))},
                       {"phase": "backward", "label": "", **_stamps(0.4, 1.0, (0.7, 1.9))}], "spans": []}


def calling_step(helper=True, cpu=None) -> dict:
    """Backward 0-1 s on the wall, an all-reduce of 1 MB blocking from 1 to 3 s (waiting for the
    other rank), optimizer 3-3.5 s; the CPU clock as given (default: 1.9, 2.0, 2.8 s at those marks)."""
    at = cpu or {0.0: 0.0, 1.0: 1.9, 3.0: 2.0, 3.5: 2.8}
    call = {"kind": "call", "op": "all_reduce", "group": "dp", "tag": "grads", "payload_bytes": 10**6,
            "sent_bytes": 10**6, **_stamps(1.0, 3.0, (at[1.0], at[3.0]), helper), "id": 0, "peer": None,
            "waits": [], "posted": False}
    return {"step": 3, "wall_s": 3.5, "cpu_s": at[3.5],
            "phases": [{"phase": "backward", "label": "", **_stamps(0.0, 1.0, (at[0.0], at[1.0]), helper)},
                       {"phase": "optimizer", "label": "", **_stamps(1.0, 3.5, (at[1.0], at[3.5]), helper)}],
            "spans": [call]}


def run_of(steps: list[dict], threads: int | None) -> list[dict]:
    events = [{"rank": r, "coords": {"dp": r}, "groups": {"dp": list(range(len(steps)))}, "steps": [step]}
              for r, step in enumerate(steps)]
    if threads is not None:
        for e in events:
            e["threads"] = threads
    return events


def block_of(events: list[dict], peak_per_core: float = 1e9) -> dict:
    from parallel.replay.device import cores_per_rank

    return replay_run(events, LINKS, tokens_per_step=1000, flops_per_token=1e6,
                      peak_per_device=peak_per_core * cores_per_rank(events))[0]


def test_a_rank_of_several_threads_is_replayed_on_its_wall_step_not_its_threads_summed_cpu():
    several = block_of(run_of([alone_step()], threads=2))
    assert several["step_time_s"] == pytest.approx(1.0)
    assert several["time_breakdown_s"]["compute"] == pytest.approx(1.0)
    assert several["device_per_rank"] == {"cores": 2, "intra_op_threads": 2, "compute_clock": "wall",
                                          "in_words": "2 cores, compute on the wall clock"}
    assert "2 cores, compute on the wall clock" in several["definition"]
    # The MFU divides by the rank's two cores' peak: 1e9 FLOPs per step in 1 s over 2e9 FLOP/s.
    assert several["mfu"]["mfu"] == pytest.approx(0.5)
    # One thread: one core, on the compute thread's CPU clock (contention left out).
    one = block_of(run_of([alone_step()], threads=1))
    assert one["step_time_s"] == pytest.approx(1.9)
    assert one["device_per_rank"]["compute_clock"] == "thread_cpu"
    assert one["mfu"]["mfu"] == pytest.approx(1e9 / 1.9 / 1e9)
    # A run saved before the threads were recorded replays as it was saved: on its CPU stamps.
    assert block_of(run_of([alone_step()], threads=None))["step_time_s"] == pytest.approx(1.9)


def test_a_rank_of_several_threads_has_its_calls_timed_by_the_links_not_by_its_wall_clock():
    several = replay_steps(run_of([calling_step(), calling_step()], threads=2), LINKS)[0]
    # Its 1.5 s of compute on the wall, and the all-reduce of 1 MB at 1 GB/s: not the 2 s it waited.
    assert 1.5 < several.step_s < 1.51
    # As a rank of one thread whose CPU clock read those wall stamps and took no CPU for its call
    # (the wall clock of its compute already holds what its gloo threads took of its cores).
    wall = {0.0: 0.0, 1.0: 1.0, 3.0: 3.0, 3.5: 3.5}
    twin = replay_steps(run_of([calling_step(helper=False, cpu=wall)] * 2, threads=1), LINKS)[0]
    assert several.step_s == pytest.approx(twin.step_s)
    # On one thread the call's own 0.1 s of CPU stays with the op, and the compute is 1.9 + 0.8 s.
    one = replay_steps(run_of([calling_step(), calling_step()], threads=1), LINKS)[0]
    assert one.step_s == pytest.approx(2.7 + 0.1, abs=0.01)
