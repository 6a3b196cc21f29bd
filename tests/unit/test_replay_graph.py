"""graph.communication_cpu on a synthetic saved step with known answers: the CPU of the rank's
other threads (gloo's) goes to the ops in flight, by payload; the calling thread's CPU inside a
call or a wait to its ops; what ran while nothing was in flight stays unattributed."""

from __future__ import annotations

import pytest

from parallel.replay import graph
from parallel.replay.engine import Call, Post
from parallel.replay.links import loopback


def _phase(phase, start, end, cpu, helper):
    return {"phase": phase, "label": "", "start": start, "end": end, "cpu_start": cpu[0], "cpu_end": cpu[1],
            "helper_start": helper[0], "helper_end": helper[1]}


def _span(kind, tag, payload, when, cpu, helper, id, waits=()):
    return {"kind": kind, "op": "all_reduce", "group": "dp", "tag": tag, "payload_bytes": payload,
            "sent_bytes": float(payload), "start": when[0], "end": when[1], "cpu_start": cpu[0], "cpu_end": cpu[1],
            "helper_start": helper[0], "helper_end": helper[1], "id": id, "peer": None, "waits": list(waits),
            "posted": False}


def overlapped_step() -> dict:
    """Forward 0-4 s, backward 4-10 s; two buckets posted at 5 and 6 s (100 and 300 bytes) and
    waited for together from 8 to 9 s. The other threads' CPU clock: 0.5 s by 4, 1.0 by 5, 1.4 by
    6, 2.6 by 8, 3.0 by 9 and after."""
    return {"phases": [_phase("forward", 0, 4, (0, 3.5), (0, 0.5)), _phase("backward", 4, 10, (3.5, 8), (0.5, 3.0))],
            "spans": [_span("post", "g0", 100, (5, 5), (4.5, 4.5), (1.0, 1.0), 0),
                      _span("post", "g1", 300, (6, 6), (5.5, 5.5), (1.4, 1.4), 1),
                      _span("wait", "g0", 0, (8, 9), (7.0, 7.4), (2.6, 3.0), 2, waits=(0, 1))]}


def _keyed(step):
    keys = iter([("coll", "dp", (0, 1), 0), ("coll", "dp", (0, 1), 1)])
    return [(s, None if s["kind"] == "wait" else next(keys)) for s in step["spans"]]


def test_the_other_threads_cpu_goes_to_the_ops_in_flight_by_payload():
    spent, unattributed = graph.communication_cpu(overlapped_step(), _keyed(overlapped_step()))
    # 5-6 s: g0 alone (0.4); 6-8 s and 8-9 s: g0 a quarter, g1 three quarters (1.2, 0.4); the wait's
    # own 0.4 s of the calling thread split the same way; 0-5 s nothing in flight (1.0).
    assert spent[("coll", "dp", (0, 1), 0)] == pytest.approx(0.4 + 0.3 + 0.1 + 0.1)
    assert spent[("coll", "dp", (0, 1), 1)] == pytest.approx(0.9 + 0.3 + 0.3)
    assert unattributed == pytest.approx(1.0)


def test_a_blocking_call_gets_its_calling_threads_cpu_and_the_other_threads_meanwhile():
    step = {"phases": [_phase("backward", 0, 3, (0, 2), (0, 0.6))],
            "spans": [_span("call", "g0", 100, (1, 2), (1.0, 1.2), (0.1, 0.6), 0)]}
    spent, unattributed = graph.communication_cpu(step, [(step["spans"][0], ("coll", "dp", (0, 1), 0))])
    assert spent == {("coll", "dp", (0, 1), 0): pytest.approx(0.2 + 0.5)}
    assert unattributed == pytest.approx(0.1)


def test_the_ops_carry_every_members_cpu_and_a_step_saved_without_it_carries_none():
    links = loopback(1e9, 1e-4)
    programs = graph.build([overlapped_step(), overlapped_step()], [{"dp": [0, 1]}] * 2, links)
    ops = [task.op for task in programs[0] if isinstance(task, (Post, Call))]
    assert [op.cpu for op in ops] == [{0: pytest.approx(0.9), 1: pytest.approx(0.9)},
                                      {0: pytest.approx(1.5), 1: pytest.approx(1.5)}]
    device = graph.build([overlapped_step(), overlapped_step()], [{"dp": [0, 1]}] * 2, links, with_cpu=False)
    assert all(task.op.cpu is None for task in device[0] if isinstance(task, Post))
    old = overlapped_step()
    for record in (*old["phases"], *old["spans"]):
        del record["helper_start"], record["helper_end"]
    assert graph.communication_cpu(old, _keyed(old)) is None
    programs = graph.build([old, overlapped_step()], [{"dp": [0, 1]}] * 2, links)
    assert all(task.op.cpu is None for task in programs[1] if isinstance(task, Post))


def test_a_step_back_of_the_other_threads_clock_cancels_against_the_next_stamp():
    # The clock reads 1.0 at the post, 0.95 at a phase mark in flight (its noise), 1.6 at the wait:
    # the op gets 0.6, as if the middle stamp had not been there.
    step = {"phases": [_phase("backward", 0, 2, (0, 1), (0, 0.95)), _phase("optimizer", 2, 5, (1, 2), (0.95, 1.6))],
            "spans": [_span("post", "g0", 100, (1, 1), (0.5, 0.5), (1.0, 1.0), 0),
                      _span("wait", "g0", 0, (4, 4), (1.8, 1.8), (1.6, 1.6), 1, waits=(0,))]}
    spent, unattributed = graph.communication_cpu(step, [(step["spans"][0], ("coll", "dp", (0, 1), 0)),
                                                         (step["spans"][1], None)])
    assert spent[("coll", "dp", (0, 1), 0)] == pytest.approx(0.6)
    assert unattributed == pytest.approx(1.0)


def _blocking_step(helper_in_call: float, tags=("g0",)) -> dict:
    """Backward 0-3 s with blocking all-reduces of 100 bytes, one a second from 1 s: the calling
    thread takes 0.2 s of CPU in each, the other threads `helper_in_call` s, and nothing outside."""
    spans, helper = [], 0.0
    for k, tag in enumerate(tags):
        spans.append(_span("call", tag, 100, (1 + k, 1.5 + k), (1.0 + k, 1.2 + k),
                           (helper, helper + helper_in_call), k))
        helper += helper_in_call
    return {"phases": [_phase("backward", 0, 1 + len(tags), (0, 1 + len(tags)), (0, helper))], "spans": spans}


def _run(*steps_of_rank) -> list[dict]:
    return [{"rank": r, "groups": {"dp": [0, 1]}, "steps": steps} for r, steps in enumerate(steps_of_rank)]


def test_an_ops_cpu_is_its_lower_median_over_the_run_so_one_calls_tail_is_not_replayed():
    from parallel.replay.virtual import replay_step, replay_steps

    # Rank 0's second call took 4.5 s of its other threads' CPU (the machine's tail), every other
    # call 0.5 s: the op's figure is 0.2 + 0.5 s on both members in every step.
    events = _run([_blocking_step(0.5), _blocking_step(4.5), _blocking_step(0.5)], [_blocking_step(0.5)] * 3)
    identity = ("coll", "dp", (0, 1), 0, "all_reduce", "g0", 100)
    assert graph.median_op_cpu(events) == {(identity, 0): pytest.approx(0.7), (identity, 1): pytest.approx(0.7)}
    links = loopback(1e9, 1e-4)
    steps = [r.step_s for r in replay_steps(events, links)]
    assert steps == [pytest.approx(steps[0])] * 3
    assert steps[0] == pytest.approx(replay_step(events, 0, links).step_s)
    # The step's own figure: the op lasts as long as its busiest member's 4.7 s of CPU, 4 s more.
    assert replay_step(events, 1, links).step_s == pytest.approx(steps[0] + 4.0)
    # Ranks sharing cores (the contention replay reproduces the machine the run shared): each call
    # keeps the CPU the contended run really spent.
    shared = replay_steps(events, links, cores=2)
    assert shared[1].step_s == pytest.approx(replay_step(events, 1, links, 2).step_s)
    assert shared[1].step_s > shared[0].step_s + 3.9
    # Not charged (a device's copy engines): no CPU, no medians.
    assert replay_steps(events, links, with_cpu=False)[1].step_s < steps[1]


def test_an_op_only_one_step_has_keeps_its_own_cpu_and_shifts_no_other_op():
    # Step 1 makes an extra call first: its g0 is the group's second call there, not the same op as
    # step 0's first, so each keeps its own figure; a step saved without the other threads' clock
    # gives no medians at all.
    events = _run([_blocking_step(0.5), _blocking_step(2.0, tags=("extra", "g0"))],
                  [_blocking_step(0.5), _blocking_step(2.0, tags=("extra", "g0"))])
    medians = graph.median_op_cpu(events)
    assert medians[(("coll", "dp", (0, 1), 0, "all_reduce", "g0", 100), 0)] == pytest.approx(0.7)
    assert medians[(("coll", "dp", (0, 1), 0, "all_reduce", "extra", 100), 0)] == pytest.approx(2.2)
    assert medians[(("coll", "dp", (0, 1), 1, "all_reduce", "g0", 100), 0)] == pytest.approx(2.2)
    programs = graph.build([e["steps"][1] for e in events], [e["groups"] for e in events], loopback(1e9, 1e-4),
                           op_cpu=medians)
    assert [task.op.cpu[0] for task in programs[0] if isinstance(task, Call)] == [pytest.approx(2.2)] * 2
    old = _blocking_step(0.5)
    for record in (*old["phases"], *old["spans"]):
        del record["helper_start"], record["helper_end"]
    assert graph.median_op_cpu(_run([old], [old])) is None
