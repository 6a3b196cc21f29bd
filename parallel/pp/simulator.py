"""Run schedules (lists of actions per rank) with given costs, and check them.

The simulator plays every rank's list in order under the executor's rules: a send is posted
without waiting, a receive waits until its message has been sent, a compute takes its cost. It
proves, for the lists it is given, that

* they finish: no rank waits forever for a message (a deadlock is reported with every rank's
  blocked action);
* every microbatch runs forward then backward exactly once on every virtual stage, each receive
  gets the message of the right microbatch from the right neighbour, and no message is left
  unreceived;

and it measures what the closed forms predict: the bubble (the share of rank-time spent idle)
and the most activations each rank holds at once (forwards done whose backward has not run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from parallel.pp.schedules import B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, stage_location, virtual_stage


class ScheduleInvalid(AssertionError):
    """The lists break a rule of pipelining (deadlock, missing or repeated work, a stray message)."""


@dataclass
class Span:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    stages: int
    microbatches: int
    virtual: int
    makespan: float
    busy: list[float]
    peak_activations: list[int]
    spans: list[Span] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: 1 - busy / (p · makespan)."""
        return 1.0 - sum(self.busy) / (self.stages * self.makespan)


def unit_costs(forward: float = 1.0, backward: float = 2.0, comm: float = 0.0):
    """Costs per action for a rank's whole share of the model; a chunk costs 1/v of it."""

    def cost(action: Action, virtual: int) -> float:
        if action.op == F:
            return forward / virtual
        if action.op == B:
            return backward / virtual
        return comm

    return cost


def simulate(plans: list[list[Action]], microbatches: int, virtual: int = 1, cost=None) -> SimResult:
    cost = cost or unit_costs()
    p = len(plans)
    last_vstage = p * virtual - 1
    clock = [0.0] * p
    cursor = [0] * p
    busy = [0.0] * p
    held = [0] * p
    peak = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # (kind, mb, destination vstage) -> arrival time
    done = Counter()
    spans: list[Span] = []

    def message_key(rank: int, a: Action) -> tuple[str, int, int]:
        vs = virtual_stage(rank, a.chunk, p)
        if a.op == SEND_F:
            return ("act", a.mb, vs + 1)
        if a.op == RECV_F:
            return ("act", a.mb, vs)
        if a.op == SEND_B:
            return ("grad", a.mb, vs - 1)
        return ("grad", a.mb, vs)  # RECV_B

    def run_one(rank: int) -> bool:
        a = plans[rank][cursor[rank]]
        vs = virtual_stage(rank, a.chunk, p)
        start = clock[rank]
        if a.op in (RECV_F, RECV_B):
            key = message_key(rank, a)
            if key not in sent:
                return False  # blocked: the message has not been sent yet
            start = max(start, sent.pop(key))
        elif a.op in (SEND_F, SEND_B):
            key = message_key(rank, a)
            if not 0 <= key[2] <= last_vstage:
                raise ScheduleInvalid(f"rank {rank}: {a} sends past the ends of the pipeline")
            if key in sent:
                raise ScheduleInvalid(f"rank {rank}: {a} sent twice")
            sent[key] = start + cost(a, virtual)
        else:
            if a.op == B and done[(F, a.mb, vs)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before the forward of microbatch {a.mb} on virtual stage {vs}")
            if a.op == F and vs > 0 and done[(F, a.mb, vs - 1)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before its input exists")
            if a.op == B and vs < last_vstage and done[(B, a.mb, vs + 1)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before its output gradient exists")
            if done[(a.op, a.mb, vs)]:
                raise ScheduleInvalid(f"rank {rank}: {a} runs twice")
            done[(a.op, a.mb, vs)] += 1
            busy[rank] += cost(a, virtual)
            held[rank] += 1 if a.op == F else -1
            peak[rank] = max(peak[rank], held[rank])
        end = start + cost(a, virtual)
        clock[rank] = end
        spans.append(Span(rank, a, start, end))
        cursor[rank] += 1
        return True

    while any(cursor[r] < len(plans[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while cursor[r] < len(plans[r]) and run_one(r):
                progressed = True
        if not progressed:
            blocked = {r: str(plans[r][cursor[r]]) for r in range(p) if cursor[r] < len(plans[r])}
            raise ScheduleInvalid(f"deadlock: every unfinished rank waits for a message that is never sent: {blocked}")

    for vs in range(p * virtual):
        rank, chunk = stage_location(vs, p)
        for mb in range(microbatches):
            for op in COMPUTE:
                if done[(op, mb, vs)] != 1:
                    raise ScheduleInvalid(f"microbatch {mb} ran {op} {done[(op, mb, vs)]} times on virtual stage {vs} (rank {rank}, chunk {chunk})")
    if sent:
        raise ScheduleInvalid(f"messages never received: {sorted(sent)}")
    return SimResult(p, microbatches, virtual, max(clock), busy, peak, spans)
