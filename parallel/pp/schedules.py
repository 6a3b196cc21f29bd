"""Pipeline schedules as data: each one a record, `Schedule`, in one table, `SCHEDULES`.

A schedule's builder is a pure function `(stages, microbatches, virtual) -> one list of actions
per rank`. Nothing here communicates or computes: the simulator (simulator.py) runs these lists
with given costs to prove them correct and predict the bubble, the executor runs the very same
lists with real sends and receives, the timeline draws them and the planner times them.

A record holds everything the rest of the project reads of a schedule:

    name         parallel.schedule
    build        the builder: the action lists
    placement    which rank holds which virtual stage (placement.py: the loop, or the V)
    idle         its bubble in closed form: the idle time each chain of dependent actions forces
                 (a rank's idle is their max), or None where no closed form is known (the run then
                 trains and reports "no closed form"; the simulator's bubble stands alone)
    torch_class  torch.distributed.pipelining's class of the same order (the torch_pp baseline), or None
    in_flight    how many microbatches of each of its chunks its first rank holds (each one's forward
                 run, the backward that frees it not yet) at a moment it holds the most of them, in
                 closed form, or None where none is stated (`first_rank_in_flight` then answers with
                 one microbatch of every chunk)
    check        the sizes its builder refuses, stated apart (the builder calls it first and refuses
                 nothing else), so that run_plan.py checks a layout without building its lists
                 (`check_schedule`); None: the builder is asked
    splits       whether its lists run each W apart from its B (the zero-bubble schedules), at every
                 size, so that a rule reading it need not build them (`schedule_splits_backward`);
                 None: the lists are read

A new schedule is one record (and its builder and formula beside it) passed to `register_schedule`,
plus a preset in conf/parallel/. The vocabulary (F, B, W, the sends and receives) is in actions.py.
This file holds the schedules with one whole backward per microbatch and chunk (GPipe, 1F1B,
interleaved 1F1B, all on the loop placement); zero_bubble.py holds the builders and formulas of
those that split it (ZB-H1, ZB-V, DualPipeV).

The bubble. F, B and W are the times of one microbatch through a rank's whole share of the model:
forward, input-gradient backward, weight-gradient backward (so B + W is the whole backward, which
the schedules that do not split it run as one action). Every rank does the same work per step,
m(F + B + W), so every rank is idle for the same time (makespan - work), and the bubble, the idle
share of all rank-time, is

    bubble = idle / (m(F + B + W) + idle).

(The functions take these times as time_f, time_b, time_w: F, B and W are the actions' names.)

The idle times are what the schedules take when each action costs exactly its time and messages
are free; the simulator reproduces them exactly for every p <= 8, m <= 16
(tests/unit/test_pp_zero_bubble.py). Where they come from, with sources: docs/theory/pipeline.md.

Building is cached (`built_schedule`), and every caller gets fresh lists of the same actions. What a
check needs is stated in the record without building (`check_schedule`, `schedule_splits_backward`,
`first_rank_in_flight`): the planner's search asks run_plan.py about thousands of (schedule, p, m, v),
most of which it never needs the lists of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from parallel.pp.actions import (  # noqa: F401  (re-exported: the vocabulary is used as schedules.F, ...)
    COMM,
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    check_sizes,
    compute_only,
    splits_backward,
    with_comm,
)
from parallel.pp.placement import LOOP, Placement, V
from parallel.pp.zero_bubble import (
    check_dualpipe_v,
    check_zb_h1,
    check_zb_v,
    dualpipe_v,
    dualpipe_v_idle,
    dualpipe_v_in_flight,
    zb_h1,
    zb_h1_idle,
    zb_v,
    zb_v_idle,
    zb_v_in_flight,
)


def virtual_stage(rank: int, chunk: int, stages: int) -> int:
    """(rank, chunk) -> virtual stage on the loop placement (all but the V-shaped schedules)."""
    return chunk * stages + rank


def _with_comm(compute: list[Action], rank: int, stages: int, virtual: int) -> list[Action]:
    return with_comm(compute, rank, Placement(stages, virtual))


def _check(stages: int, microbatches: int, virtual: int) -> None:
    check_sizes(stages, microbatches, virtual)


def loop_idle(stages: int, microbatches: int, virtual: int, time_f, time_b, time_w) -> list:
    """GPipe, 1F1B and interleaved 1F1B (m a multiple of p): (p-1)(F + B + W)/v (Huang 2018;
    Narayanan 2021 §2.2.1, §2.2.2). With W = 0: bubble (p-1)/(m+p-1), interleaved (p-1)/(v·m+p-1)."""
    return [(stages - 1) * (time_f + time_b + time_w) / Fraction(virtual)]


def gpipe_in_flight(stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """Every forward comes before the first backward: the first rank holds all m microbatches."""
    return (microbatches,)


def one_f_one_b_in_flight(stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """p-1 warm-up forwards and one more before the first backward frees one: min(p, m) held."""
    return (min(stages, microbatches),)


def interleaved_in_flight(stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """The first rank's 2(p-1) + (v-1)p warm-up forwards and the steady state's one more, all of them
    where that is every forward of the step (m·v), none freed yet; forward k is of chunk (k // p) mod v
    (`interleaved_1f1b`'s groups of p). With one chunk per rank, 1F1B's."""
    p, m, v = stages, microbatches, virtual
    if v == 1:
        return one_f_one_b_in_flight(p, m, v)
    held = [0] * v
    for k in range(min(2 * (p - 1) + (v - 1) * p + 1, m * v)):
        held[(k // p) % v] += 1
    return tuple(held)


def one_chunk_check(name: str):
    """The refusals of a schedule that runs one chunk per rank (gpipe, 1f1b): the sizes, and any virtual stages."""

    def check(stages: int, microbatches: int, virtual: int) -> None:
        _check(stages, microbatches, virtual)
        if virtual != 1:
            raise ScheduleError(f"parallel.virtual_stages={virtual}: {name} runs one chunk per rank; "
                                "use pp_interleaved for virtual stages")

    return check


check_gpipe, check_1f1b = one_chunk_check("gpipe"), one_chunk_check("1f1b")


def gpipe(stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2018): every forward, then every backward.

    Simple, and holds all m microbatches' activations at once. Bubble (p-1)/(m+p-1).
    """
    check_gpipe(stages, microbatches, virtual)
    m = microbatches
    return [_with_comm([Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)], r, stages, 1)
            for r in range(stages)]


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1).

    Rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward and one backward,
    then drains the remaining backwards. Same bubble as GPipe, but a rank holds at most p-r
    microbatches' activations instead of m. Works for any m >= 1: with m < p the warm-up is
    capped at m (torchtitan #775 hung when it was not).
    """
    check_1f1b(stages, microbatches, virtual)
    plans = []
    for r in range(stages):
        warmup = min(stages - r - 1, microbatches)
        compute = [Action(F, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            compute += [Action(F, warmup + i), Action(B, i)]
        compute += [Action(B, i) for i in range(microbatches - warmup, microbatches)]
        plans.append(_with_comm(compute, r, stages, 1))
    return plans


def check_interleaved(stages: int, microbatches: int, virtual: int) -> None:
    _check(stages, microbatches, virtual)
    p, m = stages, microbatches
    if m % p:
        raise ScheduleError(
            f"parallel.microbatches={m} is not a multiple of parallel.pp={p}, which the interleaved schedule needs "
            "(microbatches go through the chunks in groups of p): "
            f"use parallel.microbatches={max(p, m // p * p)} or {(m // p + 1) * p}"
        )


def interleaved_1f1b(stages: int, microbatches: int, virtual: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2.2), Megatron-LM's ordering.

    Each rank holds v chunks. Microbatches go through the chunks in groups of p: forwards of
    microbatches 0..p-1 on chunk 0, then the same microbatches on chunk 1, ..., then the next
    group. Backwards go the same way with the chunks reversed. Rank r runs
    (p-r-1)·2 + (v-1)·p warm-up forwards (all of them if fewer), then alternates.
    The bubble shrinks to (p-1)/(v·m+p-1). Megatron requires m to be a multiple of p.
    """
    check_interleaved(stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    if v == 1:
        return one_f_one_b(p, m)  # one chunk per rank: nothing to interleave
    total = m * v  # forward (and backward) computations per rank

    def forward_at(k: int) -> Action:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return Action(F, mb, chunk)

    def backward_at(k: int) -> Action:
        f = forward_at(k)
        return Action(B, f.mb, v - 1 - f.chunk)

    plans = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        compute = [forward_at(k) for k in range(warmup)]
        for k in range(total - warmup):
            compute += [forward_at(warmup + k), backward_at(k)]
        compute += [backward_at(k) for k in range(total - warmup, total)]
        plans.append(_with_comm(compute, r, p, v))
    return plans


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule (the fields: this module's docstring)."""

    name: str
    build: Callable[[int, int, int], list[list[Action]]]
    placement: str = LOOP
    # (stages, microbatches, virtual, time_f, time_b, time_w) -> the idle chains, or None for sizes it does not
    # cover (ZB-V below m = 2p-1); None itself: no closed form at all.
    idle: Callable[..., list | None] | None = None
    torch_class: str | None = None
    # (stages, microbatches, virtual) -> microbatches of each chunk the first rank holds at its peak; None: not stated.
    in_flight: Callable[[int, int, int], tuple[int, ...]] | None = None
    # (stages, microbatches, virtual) -> None, or ScheduleError: the builder's refusals; None: build to know.
    check: Callable[[int, int, int], None] | None = None
    splits: bool | None = None  # W apart from B at every size; None: read off the lists


SCHEDULES: dict[str, Schedule] = {}


def register_schedule(schedule: Schedule) -> Schedule:
    """Add a schedule: run_plan.py accepts parallel.schedule=<its name>, the executor runs it, the
    simulator and the timeline read it, the planner searches it. A name is registered once."""
    if schedule.name in SCHEDULES:
        raise ValueError(f"schedule {schedule.name!r} is registered twice")
    Placement(1, 2 if schedule.placement == V else 1, schedule.placement)  # refuses an unknown placement
    SCHEDULES[schedule.name] = schedule
    built_schedule.cache_clear()
    return schedule


def unregister_schedule(name: str) -> None:
    """Take a registered schedule out again (a test that adds one for its own length)."""
    del SCHEDULES[name]
    built_schedule.cache_clear()


def schedule_of(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ScheduleError(f"parallel.schedule={name!r} is not a schedule: choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_placement(name: str, stages: int, virtual: int = 1) -> Placement:
    """Which rank holds which virtual stage under schedule `name` (the simulator, the executor and
    the traffic formulas all ask this, never `vstage % p`)."""
    return Placement(stages, virtual, schedule_of(name).placement)


@lru_cache(maxsize=512)
def built_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> tuple[tuple[Action, ...], ...]:
    """The action lists, built once per (name, p, m, v) and kept immutable (a refusal is not kept:
    it is raised again, with its message, each time). 512 kept: a large planner search reads the
    lists of each layout it predicts twice (its identity, then its walk), a few hundred shapes for
    tests/tools/test_planner_search.py's 3,072 devices."""
    return tuple(tuple(actions) for actions in schedule_of(name).build(stages, microbatches, virtual))


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """One fresh list of actions per rank (the cached ones, copied: a caller may change its own)."""
    return [list(actions) for actions in built_schedule(name, stages, microbatches, virtual)]


def check_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise the ScheduleError building the lists would raise, without building them where the record
    states its builder's refusals (`check`): the planner's search asks run_plan.py about thousands of
    pipeline shapes, each list O(p·m·v) actions long, and most of them are never built otherwise."""
    check = schedule_of(name).check
    if check is None:
        built_schedule(name, stages, microbatches, virtual)
    else:
        check(stages, microbatches, virtual)


def schedule_splits_backward(name: str, stages: int, microbatches: int, virtual: int = 1) -> bool:
    """Whether the schedule's lists at these sizes run W apart from B (`splits_backward`): the record's
    `splits` where it states it, without building them (run_plan.py asks it of every layout that saves
    the sequence piece under a pipeline), else read off the lists."""
    splits = schedule_of(name).splits
    if splits is None:
        return splits_backward(built_schedule(name, stages, microbatches, virtual))
    return splits


def first_rank_in_flight(name: str, stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """How many microbatches of each of its chunks the first pipeline rank holds at a moment it holds
    the most (the record's `in_flight`), or, where the record states none, counts it holds at some
    moment: one microbatch of each chunk, which every schedule holds at once (a microbatch's backward
    through a chunk waits for its forward through every virtual stage, so when its last forward on the
    rank has run, none of its chunks is freed). The planner's memory floor
    (parallel/planner/memory_floor.py) reads it without building the lists."""
    in_flight = schedule_of(name).in_flight
    return (1,) * virtual if in_flight is None else in_flight(stages, microbatches, virtual)


# -- the bubble in closed form, from the record's `idle` ------------------------------------------------
def _idle(name: str, stages: int, microbatches: int, virtual: int, time_f, time_b, time_w) -> list | None:
    idle = schedule_of(name).idle
    return None if idle is None else idle(stages, microbatches, virtual, time_f, time_b, time_w)


def has_closed_form(name: str, stages: int, microbatches: int, virtual: int = 1) -> bool:
    """Whether a closed form is claimed for these sizes (ZB-V: only from m = 2p-1 on; a schedule
    without an `idle` formula: never)."""
    return _idle(name, stages, microbatches, virtual, 1, 1, 1) is not None


def closed_form_note(name: str, stages: int, microbatches: int, virtual: int = 1) -> str | None:
    """None where a closed form is claimed, else what the summary says instead of a number."""
    if schedule_of(name).idle is None:
        return f"no closed form: schedule {name} has none (its bubble is simulated only)"
    if not has_closed_form(name, stages, microbatches, virtual):
        return f"no closed form for {name} at p={stages}, m={microbatches} (its bubble is simulated only)"
    return None


def idle_terms(name: str, stages: int, microbatches: int, virtual: int, time_f, time_b, time_w) -> list:
    """The idle time each candidate chain of dependent actions forces; a rank's idle is their max."""
    terms = _idle(name, stages, microbatches, virtual, time_f, time_b, time_w)
    if terms is None:
        raise ValueError(closed_form_note(name, stages, microbatches, virtual) + ": simulate it")
    return terms


def closed_form_idle(name: str, stages: int, microbatches: int, virtual: int, time_f, time_b, time_w):
    """Each rank's idle time in one step (the longest chain's); None where no closed form is claimed."""
    terms = _idle(name, stages, microbatches, virtual, time_f, time_b, time_w)
    return None if terms is None else max(terms)


def closed_form_bubble(name: str, stages: int, microbatches: int, virtual: int, time_f, time_b,
                       time_w) -> Fraction | None:
    """The idle share of all rank-time: idle / (m(F+B+W) + idle); None where no closed form is claimed."""
    idle = closed_form_idle(name, stages, microbatches, virtual, time_f, time_b, time_w)
    if idle is None:
        return None
    work = microbatches * (Fraction(time_f) + Fraction(time_b) + Fraction(time_w))
    return Fraction(idle) / (work + Fraction(idle))


for _schedule in (
    Schedule("gpipe", gpipe, LOOP, loop_idle, "ScheduleGPipe", gpipe_in_flight, check_gpipe, False),
    Schedule("1f1b", one_f_one_b, LOOP, loop_idle, "Schedule1F1B", one_f_one_b_in_flight, check_1f1b, False),
    Schedule("interleaved_1f1b", interleaved_1f1b, LOOP, loop_idle, "ScheduleInterleaved1F1B", interleaved_in_flight,
             check_interleaved, False),
    # ZB-H1 with one stage per rank is torch's interleaved zero-bubble schedule's order.
    # Its first rank runs each W right after its B: 1F1B's microbatches in flight.
    Schedule("zbh1", zb_h1, LOOP, zb_h1_idle, "ScheduleInterleavedZeroBubble", one_f_one_b_in_flight, check_zb_h1,
             True),
    Schedule("zbv", zb_v, V, zb_v_idle, "ScheduleZBVZeroBubble", zb_v_in_flight, check_zb_v, True),
    Schedule("dualpipev", dualpipe_v, V, dualpipe_v_idle, "ScheduleDualPipeV", dualpipe_v_in_flight, check_dualpipe_v,
             True),
):
    register_schedule(_schedule)
