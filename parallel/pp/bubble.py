"""The pipeline bubble in closed form, for F, B and W times given separately.

F, B and W are the times of one microbatch through a rank's whole share of the model: forward,
input-gradient backward, weight-gradient backward (so B + W is the whole backward, which the
schedules that do not split it run as one action). A rank with v chunks spends F/v, B/v, W/v per
chunk; the V-shaped schedules' terms read best in chunk times f = F/2, b = B/2, w = W/2.

Every rank does the same work per step, m(F + B + W), so every rank is idle for the same time
(makespan - work), and the bubble, the idle share of all rank-time, is

    bubble = idle / (m(F + B + W) + idle).

The idle times below are what the schedules in schedules.py and zero_bubble.py take when each
action costs exactly its time and messages are free; the simulator reproduces them exactly for
every p <= 8, m <= 16 (tests/unit/test_pp_zero_bubble.py). Where they come from, with sources:
docs/theory/pipeline.md.
"""

from __future__ import annotations

from fractions import Fraction


def _zb_v_chains(p: int, f, b, w) -> list:
    """ZB-V's eight longest chains less the work (docs/theory/pipeline.md names each), chunk times."""
    return [(p - 1) * b, b + (p - 2) * w, f + (p - 2) * w, (2 * p - 3) * f - (p - 2) * b,
            2 * (p - 1) * (b - w), 2 * (p - 1) * f - (p - 1) * b - w, 2 * (p - 1) * f - (2 * p - 1) * w,
            (2 * p - 3) * f + b - 2 * (p - 1) * w]


def _dualpipe_v_chains(p: int, f, b, w) -> list:
    """DualPipeV's seven longest chains less the work (docs/theory/pipeline.md names each), chunk times."""
    return [(p - 1) * f, 2 * (p - 1) * b - (p - 1) * w - f, (p - 1) * (f + b - w), (p - 1) * b - f,
            2 * (p - 1) * f - (p - 1) * (b + w), 2 * (p - 1) * f - (2 * p - 1) * w, (2 * p - 3) * (f - w) + b]


def has_closed_form(schedule: str, stages: int, microbatches: int) -> bool:
    """ZB-V's order changes shape below m = 2p - 1 microbatches (it is built for 2p - 1 and cut
    down); there the simulator gives the bubble and no closed form is claimed. Every other
    schedule's form holds for every (p, m) the schedule accepts."""
    return not (schedule == "zbv" and microbatches < 2 * stages - 1)


def idle_terms(schedule: str, stages: int, microbatches: int, virtual: int, F, B, W) -> list:
    """The idle time each candidate chain of dependent actions forces; a rank's idle is their max.

    gpipe, 1f1b        (p-1)(F + B + W)                         Huang 2018; Narayanan 2021 §2.2.1
    interleaved_1f1b   (p-1)(F + B + W)/v   (m a multiple of p)  Narayanan 2021 §2.2.2
    zbh1               (p-1)(F+B) - (k-1)W, (p-1)F + (p-k)B, (p-1)B + (p-k)F,  k = min(m, p)
                       (max = Qi et al. 2023 §3.1's (p-1)(F + B - W) when m >= p, W <= F, W <= B)
    zbv                p = 1: 0; else eight chains in f, b, w = F/2, B/2, W/2   (m >= 2p-1)
    dualpipev          p = 1: 0; else seven chains in f, b, w                   (m >= 2p)
    """
    p, m, v = stages, microbatches, virtual
    if not has_closed_form(schedule, p, m):
        raise ValueError(f"no closed form for {schedule} with m={m} < 2p-1={2 * p - 1}: simulate it")
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        return [(p - 1) * (F + B + W) / Fraction(v)]
    if schedule == "zbh1":
        k = min(m, p)
        return [(p - 1) * (F + B) - (k - 1) * W, (p - 1) * F + (p - k) * B, (p - 1) * B + (p - k) * F]
    if schedule in ("zbv", "dualpipev"):
        if p == 1:
            return [0 * F]  # both chunks on one rank: nothing to wait for
        chains = _zb_v_chains if schedule == "zbv" else _dualpipe_v_chains
        return chains(p, Fraction(F) / 2, Fraction(B) / 2, Fraction(W) / 2)
    raise ValueError(f"no closed form for schedule {schedule!r}")


def closed_form_idle(schedule: str, stages: int, microbatches: int, virtual: int, F, B, W):
    """Each rank's idle time in one step (the longest chain's); None where no closed form is claimed."""
    if not has_closed_form(schedule, stages, microbatches):
        return None
    return max(idle_terms(schedule, stages, microbatches, virtual, F, B, W))


def closed_form_bubble(schedule: str, stages: int, microbatches: int, virtual: int, F, B, W) -> Fraction | None:
    """The idle share of all rank-time: idle / (m(F+B+W) + idle); None where no closed form is claimed.

    With W = 0 (B the whole backward) GPipe and 1F1B give (p-1)/(m+p-1), interleaved (p-1)/(v·m+p-1).
    """
    idle = closed_form_idle(schedule, stages, microbatches, virtual, F, B, W)
    if idle is None:
        return None
    work = microbatches * (Fraction(F) + Fraction(B) + Fraction(W))
    return Fraction(idle) / (work + Fraction(idle))
