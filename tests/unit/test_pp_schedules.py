"""Pipeline schedules as data, checked by the simulator over many (p, m, v).

For every valid input: the lists finish without deadlock, every microbatch runs F then B exactly
once on every virtual stage, the bubble equals the closed form (docs/theory/pipeline.md), and the activations
held per rank stay within each schedule's bound.

A schedule is a record (pp/schedules.py): a new one registered at run time
(tests/helpers/custom_schedule.py, without a closed form) is run by the simulator here, and trained
under torchrun as the single run in tests/runs/test_pp.py.
"""

from fractions import Fraction

import pytest

from parallel.pp.schedules import (
    RECV_F,
    SCHEDULES,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    build_schedule,
    built_schedule,
    closed_form_bubble,
    closed_form_note,
    compute_only,
    gpipe,
    has_closed_form,
    interleaved_1f1b,
    one_f_one_b,
    register_schedule,
    schedule_placement,
    unregister_schedule,
)
from parallel.pp.simulator import ScheduleInvalid, simulate, simulate_schedule, unit_costs

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]
COSTS = {"F=B": unit_costs(1.0, 1.0), "B=2F": unit_costs(1.0, 2.0)}


def bubble_closed_form(p, m, v=1):
    return Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize("cost", COSTS, ids=str)
@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_and_1f1b_finish_and_match_the_bubble(schedule, p, m, cost):
    result = simulate(schedule(p, m), m, cost=COSTS[cost])
    assert result.bubble_fraction == pytest.approx(float(bubble_closed_form(p, m)), abs=1e-12)
    if schedule is gpipe:
        assert result.peak_activations == [m] * p
    else:
        # 1F1B: rank r holds at most min(p - r, m) microbatches (the first stage p).
        assert result.peak_activations == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("cost", COSTS, ids=str)
@pytest.mark.parametrize("p,k,v", [(p, k, v) for p in (1, 2, 3, 4) for k in (1, 2, 3, 4) for v in (1, 2, 3, 4)])
def test_interleaved_finishes_and_matches_the_bubble(p, k, v, cost):
    m = k * p  # Narayanan: m a multiple of p
    result = simulate(interleaved_1f1b(p, m, v), m, v, cost=COSTS[cost])
    assert result.bubble_fraction == pytest.approx(float(bubble_closed_form(p, m, v)), abs=1e-12)
    # Megatron's warm-up bounds what the first rank holds: (p-1)·2 + (v-1)·p + 1 microbatch-chunks.
    assert result.peak_activations[0] <= min((p - 1) * 2 + (v - 1) * p + 1, m * v)
    if v > 1:
        # Every rank holds exactly Megatron-Core's warm-up (pipeline_parallel/schedules.py,
        # get_pp_rank_microbatches: 2(p-1-r) + (v-1)·N chunks on rank r, N contiguous microbatches a chunk, p by
        # default and at least p) and the first steady forward, or all m·v: the least any N holds.
        assert result.peak_activations == [min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) for r in range(p)]


def test_interleaved_with_one_chunk_is_1f1b_order():
    for p, m in [(2, 4), (4, 8), (3, 6)]:
        assert [compute_only(a) for a in interleaved_1f1b(p, m, 1)] == [compute_only(a) for a in one_f_one_b(p, m)]


def test_1f1b_order_on_four_stages():
    plans = one_f_one_b(4, 4)
    as_text = [" ".join(str(a) for a in compute_only(actions)) for actions in plans]
    assert as_text == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_receives_come_right_before_and_sends_right_after_their_compute():
    plans = one_f_one_b(3, 3)
    middle = plans[1]
    i = middle.index(Action(F, 0))
    assert middle[i - 1] == Action(RECV_F, 0) and middle[i + 1] == Action(SEND_F, 0)
    assert plans[0][0] == Action(F, 0)             # the first stage reads the batch: no receive
    assert plans[0][-1] == Action(B, 2)            # ... and sends no input gradient back
    assert plans[2][-1] == Action("SEND_B", 2)     # the last stage sends its input gradient back
    assert Action("RECV_B", 0) not in plans[2]     # ... but receives none: it computes the loss


def test_interleaved_refuses_microbatches_not_a_multiple_of_stages():
    with pytest.raises(ScheduleError, match=r"parallel.microbatches=6 is not a multiple of parallel.pp=4"):
        interleaved_1f1b(4, 6, 2)


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(ScheduleError, match=r"use pp_interleaved for virtual stages"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ScheduleError, match=r"parallel.schedule='zb' is not a schedule"):
        build_schedule("zb", 2, 4)


def test_simulator_catches_a_deadlock():
    # Two stages that each wait for the other's message first.
    plans = [[Action("RECV_B", 0), Action(F, 0), Action(SEND_F, 0), Action(B, 0)],
             [Action(RECV_F, 0), Action(F, 0), Action(B, 0), Action("SEND_B", 0)]]
    with pytest.raises(ScheduleInvalid, match="deadlock"):
        simulate(plans, 1)


def test_simulator_catches_a_missing_backward_and_a_repeat():
    plans = gpipe(2, 2)
    missing = [plans[0], [a for a in plans[1] if a != Action(B, 1)]]
    with pytest.raises(ScheduleInvalid):
        simulate(missing, 2)
    repeated = [plans[0] + [Action(F, 0)], plans[1]]
    with pytest.raises(ScheduleInvalid, match="twice"):
        simulate(repeated, 2)


# -- a schedule is a record ------------------------------------------------------------------------------
def test_every_schedule_is_a_record_read_by_every_reader():
    """The executor, simulator, timeline and planner all read SCHEDULES: each record builds lists the
    simulator runs, on its own placement, and has its closed form or none."""
    for name, record in SCHEDULES.items():
        assert record.name == name
        v = 2 if record.placement == "v" or name == "interleaved_1f1b" else 1
        result = simulate_schedule(name, 2, 4, v)
        assert 0 <= result.bubble_fraction < 1
        assert schedule_placement(name, 2, v).shape == record.placement
        assert (record.idle is None) == (closed_form_note(name, 2, 4, v) is not None)


def test_building_is_cached_and_every_caller_gets_its_own_lists():
    first = build_schedule("1f1b", 4, 8)
    first[0].clear()
    assert build_schedule("1f1b", 4, 8) == one_f_one_b(4, 8) and built_schedule("1f1b", 4, 8) is \
        built_schedule("1f1b", 4, 8)
    with pytest.raises(ScheduleError, match="is not a multiple"):  # a refusal is raised again each time
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match="is not a multiple"):
        build_schedule("interleaved_1f1b", 4, 6, 2)


@pytest.fixture
def gpipe_lifo():
    """tests/helpers/custom_schedule.py's record, registered for the length of one test."""
    from custom_schedule import GPIPE_LIFO

    register_schedule(GPIPE_LIFO)
    yield GPIPE_LIFO
    unregister_schedule(GPIPE_LIFO.name)


def test_a_schedule_without_a_closed_form_says_so(gpipe_lifo):
    """A schedule registered without `idle` runs everywhere and has no closed form (not a crash)."""
    assert SCHEDULES["gpipe_lifo"] is gpipe_lifo
    assert closed_form_bubble("gpipe_lifo", 4, 8, 1, 1, 2, 0) is None and not has_closed_form("gpipe_lifo", 4, 8)
    assert closed_form_note("gpipe_lifo", 4, 8).startswith("no closed form")
    # The simulator runs it: GPipe's bubble (the backwards of one rank wait for the same chain).
    assert simulate_schedule("gpipe_lifo", 4, 8).bubble_fraction == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="registered twice"):
        register_schedule(Schedule("gpipe_lifo", gpipe))
    from parallel.baselines.pipelining import check_torch_schedule

    with pytest.raises(ScheduleError, match="has no torch.distributed.pipelining counterpart"):
        check_torch_schedule("gpipe_lifo", 2, 4, 1)


def test_stages_that_differ_get_their_own_costs():
    """A measured pipeline's stages are not alike (the last computes the head and the loss): the
    simulator takes (rank, chunk) -> Costs. One microbatch through two stages, by hand: rank 0's F
    [0, 1], rank 1's F [1, 3] and B [3, 7], rank 0's B [7, 9]; busy 3 and 6 of 2 x 9."""
    heavy_last = {(0, 0): unit_costs(1, 2), (1, 0): unit_costs(2, 4)}
    for schedule in ("gpipe", "1f1b"):
        result = simulate_schedule(schedule, 2, 1, cost=heavy_last)
        assert (result.makespan, result.busy, result.bubble_fraction) == (9, [3, 6], 0.5)
    # The same costs on every stage, given either way, play the same step.
    alike = {(r, c): unit_costs(1, 2) for r in range(4) for c in range(2)}
    for schedule in ("interleaved_1f1b", "zbv"):
        assert simulate_schedule(schedule, 4, 8, 2, alike).makespan == simulate_schedule(
            schedule, 4, 8, 2, unit_costs(1, 2)).makespan
