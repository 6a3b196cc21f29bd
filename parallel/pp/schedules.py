"""Pipeline schedules as data.

A schedule is a pure function `(stages, microbatches, virtual) -> one list of actions per rank`.
Nothing here communicates or computes: the simulator (simulator.py) runs these lists with given
costs to prove them correct and predict the bubble, the executor runs the very same lists with
real sends and receives, and the timeline draws them.

The vocabulary (F, B, W, the sends and receives) is in actions.py; which rank holds which virtual
stage is each schedule's placement (placement.py, `schedule_placement` below). This file holds the
schedules with one whole backward per microbatch and chunk (GPipe, 1F1B, interleaved 1F1B, all on
the loop placement); zero_bubble.py holds those that split it (ZB-H1, ZB-V, DualPipeV).
"""

from __future__ import annotations

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
from parallel.pp.zero_bubble import dualpipe_v, zb_h1, zb_v


def virtual_stage(rank: int, chunk: int, stages: int) -> int:
    """(rank, chunk) -> virtual stage on the loop placement (all but the V-shaped schedules)."""
    return chunk * stages + rank


def stage_location(vstage: int, stages: int) -> tuple[int, int]:
    """Virtual stage -> (rank, chunk) on the loop placement."""
    return vstage % stages, vstage // stages


def _with_comm(compute: list[Action], rank: int, stages: int, virtual: int) -> list[Action]:
    return with_comm(compute, rank, Placement(stages, virtual))


def _check(stages: int, microbatches: int, virtual: int) -> None:
    check_sizes(stages, microbatches, virtual)


def gpipe(stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2018): every forward, then every backward.

    Simple, and holds all m microbatches' activations at once. Bubble (p-1)/(m+p-1).
    """
    _check(stages, microbatches, virtual)
    if virtual != 1:
        raise ScheduleError(f"parallel.virtual_stages={virtual}: gpipe runs one chunk per rank; "
                            "use pp_interleaved for virtual stages")
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
    _check(stages, microbatches, virtual)
    if virtual != 1:
        raise ScheduleError(f"parallel.virtual_stages={virtual}: 1f1b runs one chunk per rank; "
                            "use pp_interleaved for virtual stages")
    plans = []
    for r in range(stages):
        warmup = min(stages - r - 1, microbatches)
        compute = [Action(F, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            compute += [Action(F, warmup + i), Action(B, i)]
        compute += [Action(B, i) for i in range(microbatches - warmup, microbatches)]
        plans.append(_with_comm(compute, r, stages, 1))
    return plans


def interleaved_1f1b(stages: int, microbatches: int, virtual: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2.2), Megatron-LM's ordering.

    Each rank holds v chunks. Microbatches go through the chunks in groups of p: forwards of
    microbatches 0..p-1 on chunk 0, then the same microbatches on chunk 1, ..., then the next
    group. Backwards go the same way with the chunks reversed. Rank r runs
    (p-r-1)·2 + (v-1)·p warm-up forwards (all of them if fewer), then alternates.
    The bubble shrinks to (p-1)/(v·m+p-1). Megatron requires m to be a multiple of p.
    """
    _check(stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    if m % p:
        raise ScheduleError(
            f"parallel.microbatches={m} is not a multiple of parallel.pp={p}, which the interleaved schedule needs "
            "(microbatches go through the chunks in groups of p): "
            f"use parallel.microbatches={max(p, m // p * p)} or {(m // p + 1) * p}"
        )
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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b,
             "zbh1": zb_h1, "zbv": zb_v, "dualpipev": dualpipe_v}
V_SHAPED = ("zbv", "dualpipev")  # the schedules on the V placement; every other one loops


def schedule_placement(name: str, stages: int, virtual: int = 1) -> Placement:
    """Which rank holds which virtual stage under schedule `name` (the simulator, the executor and
    the traffic formulas all ask this, never `vstage % p`)."""
    return Placement(stages, virtual, V if name in V_SHAPED else LOOP)


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ScheduleError(f"parallel.schedule={name!r} is not a schedule: choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stages, microbatches, virtual)
