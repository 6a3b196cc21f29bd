"""Pipeline schedules as data.

A schedule is a pure function `(stages, microbatches, virtual) -> one list of actions per rank`.
Nothing here communicates or computes: the simulator (simulator.py) runs these lists with unit
costs to prove them correct and predict the bubble, the executor runs the very same lists with
real sends and receives, and the timeline draws them.

Vocabulary
----------
* p pipeline ranks, m microbatches, v model chunks per rank ("virtual stages").
* The model is cut into p·v consecutive pieces, the *virtual stages* 0 .. p·v-1. Rank r holds
  chunks c = 0 .. v-1, chunk c being virtual stage c·p + r (Megatron's interleaved layout: each
  rank holds v non-adjacent pieces). With v = 1, virtual stage = rank.
* Actions, each about one microbatch `mb` on one local `chunk`:
    F        forward                     B        backward
    SEND_F   send the chunk's output activation to the next virtual stage
    RECV_F   receive the chunk's input activation from the previous virtual stage
    SEND_B   send the gradient of the chunk's input to the previous virtual stage
    RECV_B   receive the gradient of the chunk's output from the next virtual stage
  A RECV is placed right before the compute that consumes it and a SEND right after the compute
  that produces it. Sends are posted without waiting (isend); a receive waits until its message
  has arrived. Under those rules a list of actions deadlocks only if its compute order does, which
  the simulator rules out.
"""

from __future__ import annotations

from dataclasses import dataclass

F, B = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True, order=True)
class Action:
    op: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A (stages, microbatches, virtual) combination the schedule cannot run."""


def virtual_stage(rank: int, chunk: int, stages: int) -> int:
    return chunk * stages + rank


def stage_location(vstage: int, stages: int) -> tuple[int, int]:
    """Virtual stage -> (rank, chunk)."""
    return vstage % stages, vstage // stages


def _with_comm(compute: list[Action], rank: int, stages: int, virtual: int) -> list[Action]:
    """Insert each compute's receive before it and its send after it.

    The first virtual stage has no one to receive an input from (it reads the batch) and the last
    computes the loss itself, so those receives and sends are left out.
    """
    last = stages * virtual - 1
    out: list[Action] = []
    for a in compute:
        vs = virtual_stage(rank, a.chunk, stages)
        if a.op == F:
            if vs > 0:
                out.append(Action(RECV_F, a.mb, a.chunk))
            out.append(a)
            if vs < last:
                out.append(Action(SEND_F, a.mb, a.chunk))
        else:
            if vs < last:
                out.append(Action(RECV_B, a.mb, a.chunk))
            out.append(a)
            if vs > 0:
                out.append(Action(SEND_B, a.mb, a.chunk))
    return out


def _check(stages: int, microbatches: int, virtual: int) -> None:
    for name, value in (("parallel.pp", stages), ("parallel.microbatches", microbatches), ("parallel.virtual_stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r} must be a positive integer")


def gpipe(stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2018): every forward, then every backward.

    Simple, and holds all m microbatches' activations at once. Bubble (p-1)/(m+p-1).
    """
    _check(stages, microbatches, virtual)
    if virtual != 1:
        raise ScheduleError(f"parallel.virtual_stages={virtual}: gpipe runs one chunk per rank; use pp_interleaved for virtual stages")
    m = microbatches
    return [_with_comm([Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)], r, stages, 1) for r in range(stages)]


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1).

    Rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward and one backward,
    then drains the remaining backwards. Same bubble as GPipe, but a rank holds at most p-r
    microbatches' activations instead of m. Works for any m >= 1: with m < p the warm-up is
    capped at m (torchtitan #775 hung when it was not).
    """
    _check(stages, microbatches, virtual)
    if virtual != 1:
        raise ScheduleError(f"parallel.virtual_stages={virtual}: 1f1b runs one chunk per rank; use pp_interleaved for virtual stages")
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
            f"(microbatches go through the chunks in groups of p): use parallel.microbatches={max(p, m // p * p)} or {(m // p + 1) * p}"
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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b}


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ScheduleError(f"parallel.schedule={name!r} is not a schedule: choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stages, microbatches, virtual)


def compute_only(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.op in COMPUTE]
