"""What a schedule's record states without building its lists is what its lists say.

run_plan.py checks a pipeline by the record's `check` (the builder's refusals, stated apart), the
tp x pp rule reads its `splits`, and the planner's memory floor its `in_flight` (how many microbatches
of each chunk the first rank holds at a moment of its peak): each is held here to the lists, for every
registered schedule over many (p, m, v). A record that states none of them (a schedule registered
at run time) is answered from its lists, or, for `in_flight`, with a count its lists never go under.
"""

import pytest

from parallel.activations import ChunkBytes, peak_in_flight
from parallel.pp.actions import B, F, W, splits_backward
from parallel.pp.schedules import (
    SCHEDULES,
    ScheduleError,
    built_schedule,
    check_schedule,
    first_rank_in_flight,
    register_schedule,
    schedule_of,
    schedule_placement,
    schedule_splits_backward,
    unregister_schedule,
)
from parallel.pp.theory import schedule_walk
from tests.helpers.custom_schedule import GPIPE_LIFO

SIZES = [(p, m, v) for p in range(1, 7) for m in range(1, 15) for v in range(1, 5)]


def _refusal(ask, name: str, p: int, m: int, v: int) -> str | None:
    """What `ask` (building the lists, or the record's check) refuses the sizes with, or None."""
    try:
        ask(name, p, m, v)
    except ScheduleError as e:
        return str(e)
    return None


def _built(name: str, p: int, m: int, v: int) -> str | None:
    return _refusal(built_schedule, name, p, m, v)


def _checked(name: str, p: int, m: int, v: int) -> str | None:
    return _refusal(check_schedule, name, p, m, v)


def first_rank_peak(name: str, p: int, m: int, v: int) -> int:
    """The walk memory.py takes, on the first rank, with every chunk of a microbatch counted as one."""
    return peak_in_flight(schedule_walk(name, p, m, v)[0], [ChunkBytes(1, False, False)] * (p * v), 0)


def held_by_chunk(name: str, p: int, m: int, v: int) -> list[tuple[int, ...]]:
    """After each action of the first rank's walk: how many microbatches of each chunk it holds, freed
    as memory.py's walk frees them (by the backward, or by W where the schedule splits it)."""
    placement, walk = schedule_placement(name, p, v), schedule_walk(name, p, m, v)[0]
    split = any(op == W for op, _ in walk)
    held, moments = [0] * v, []
    for op, vstage in walk:
        chunk = placement.location(vstage)[1]
        held[chunk] += 1 if op == F else (-1 if op == W or (op == B and not split) else 0)
        moments.append(tuple(held))
    return moments


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_check_refuses_exactly_what_the_builder_refuses_with_its_message(name):
    assert schedule_of(name).check is not None
    refused = 0
    for p, m, v in SIZES:
        assert _checked(name, p, m, v) == _built(name, p, m, v), (p, m, v)
        refused += _built(name, p, m, v) is not None
    assert 0 < refused < len(SIZES)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_stated_split_backward_is_the_lists(name):
    assert schedule_of(name).splits is not None
    for p, m, v in SIZES:
        if _built(name, p, m, v) is None:
            assert schedule_splits_backward(name, p, m, v) == splits_backward(built_schedule(name, p, m, v))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_first_ranks_stated_counts_in_flight_are_a_moment_of_the_walks_peak(name):
    """What the memory floor reads (each chunk's count at one moment) is held at once, and as many as
    the walk's peak: so each chunk's bytes times its count is what memory.py's walk holds then."""
    checked = 0
    for p in range(2, 9):
        for m in range(1, 3 * p + 3):
            for v in range(1, 5):
                if _built(name, p, m, v) is None:
                    counts = first_rank_in_flight(name, p, m, v)
                    assert counts in held_by_chunk(name, p, m, v), (p, m, v)
                    assert sum(counts) == first_rank_peak(name, p, m, v), (p, m, v)
                    checked += 1
    assert checked > 0


def test_a_record_that_states_nothing_is_answered_from_its_lists_or_under_them():
    """gpipe_lifo states no check, no split and no count: its refusals are its builder's, its split its
    lists', and its counts one microbatch of each chunk, which its walk holds at some moment (it holds m)."""
    register_schedule(GPIPE_LIFO)
    try:
        for p, m, v in SIZES:
            assert _checked("gpipe_lifo", p, m, v) == _built("gpipe_lifo", p, m, v)
            if _built("gpipe_lifo", p, m, v) is None and p > 1:
                assert not schedule_splits_backward("gpipe_lifo", p, m, v)
                assert first_rank_in_flight("gpipe_lifo", p, m, v) == (1,) * v
                assert any(min(held) >= 1 for held in held_by_chunk("gpipe_lifo", p, m, v))
    finally:
        unregister_schedule("gpipe_lifo")
