"""Run schedules (lists of actions per rank) with given costs, and check them.

The simulator plays every rank's list in order under the executor's rules: a send is posted
without waiting, a receive waits until its message has been sent, a compute takes its cost. It
proves, for the lists it is given, that

* they finish: no rank waits forever for a message (a deadlock is reported with every rank's
  blocked action);
* every microbatch runs F, then B, then (in a schedule that splits the backward) W exactly once on
  every virtual stage, each F after the previous stage's F and each B after the next stage's B,
  each receive gets the message of the right microbatch from the right neighbour, in the order
  that neighbour sent them (two ranks' messages are matched in posting order, gloo and NCCL
  alike: actions.py), and no message is left unreceived;

and it measures what the closed forms (each schedule's `idle`, schedules.py) predict: the bubble
(the share of rank-time spent idle) and the most activations each rank holds at once. A microbatch's activations on a
chunk are held from its F until its backward is complete: until B when B is the whole backward,
until W when the backward is split (W needs the layer inputs the forward saved).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from parallel.pp.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W, message, splits_backward
from parallel.pp.placement import Placement
from parallel.pp.schedules import build_schedule, schedule_placement


class ScheduleInvalid(AssertionError):
    """The lists break a rule of pipelining (deadlock, missing or repeated work, a stray message)."""


@dataclass
class Span:
    rank: int
    action: Action
    start: float
    end: float
    after: int | None = None  # index of the span this one had to wait for (None: the step's start)


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

    @property
    def bubble_exact(self) -> Fraction:
        """The same share as an exact fraction (exact when the costs are, e.g. Fractions or ints)."""
        return 1 - Fraction(sum(self.busy)) / (self.stages * Fraction(self.makespan))

    @property
    def idle(self) -> list:
        """Each rank's idle time within the step: makespan - busy."""
        return [self.makespan - b for b in self.busy]

    def critical_path(self) -> list[Span]:
        """The chain of actions that sets the makespan, first to last: each waited for the one
        before it, either the rank's previous action or (for a receive that waited) the send of
        its message. Its compute times add up to the makespan when messages are free: this is how
        the closed forms (schedules.py, zero_bubble.py) were read off, one chain per term."""
        span = max(self.spans, key=lambda s: s.end)
        chain = [span]
        while span.after is not None:
            span = self.spans[span.after]
            chain.append(span)
        return chain[::-1]


@dataclass(frozen=True)
class Costs:
    """Time of one microbatch through a rank's whole share of the model; a chunk costs 1/v of it.

    forward F; input_grad B, the backward's input-gradient half; weight_grad W, its weight-gradient
    half. A schedule that does not split the backward runs both halves as one B costing B + W.
    comm: what a send or receive action costs the rank that runs it (posting it). transfer: how
    long a message takes to arrive after its send (a link's latency plus its bytes' time); the
    closed forms take messages as free, and so does the default.
    """

    forward: float = 1.0
    input_grad: float = 2.0
    weight_grad: float = 0.0
    comm: float = 0.0
    transfer: float = 0.0

    def __call__(self, action: Action, virtual: int, split: bool = True) -> float:
        if action.op == F:
            return self.forward / virtual
        if action.op == B:
            return (self.input_grad if split else self.input_grad + self.weight_grad) / virtual
        if action.op == W:
            return self.weight_grad / virtual
        return self.comm


def unit_costs(forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Costs:
    """Costs with one whole backward time (for schedules that do not split it)."""
    return Costs(forward, backward, 0.0, comm)


def split_costs(forward: float, input_grad: float, weight_grad: float, comm: float = 0,
                transfer: float = 0) -> Costs:
    """F, B and W times given separately; an unsplit schedule's B then costs B + W."""
    return Costs(forward, input_grad, weight_grad, comm, transfer)


StageCosts = Mapping[tuple[int, int], Costs]  # (rank, chunk) -> that chunk's costs, as a whole share's


def simulate(plans: list[list[Action]], microbatches: int, virtual: int = 1, cost: Costs | StageCosts | None = None,
             placement: Placement | None = None) -> SimResult:
    """Play the lists; `placement` says which rank holds which virtual stage (loop by default).

    `cost` is one Costs for every rank and chunk (the closed forms' assumption: every stage alike),
    or a mapping (rank, chunk) -> Costs for stages that differ (a measured run's: the first stage
    embeds the tokens and the last computes the head and the loss). A mapping's Costs keep the
    meaning of one: a rank's whole share, of which a chunk costs 1/v; a message's transfer is its
    sender's."""
    per_stage = isinstance(cost, Mapping)
    uniform = None if per_stage else (cost or unit_costs())

    def price(rank: int, a: Action) -> float:
        return (cost[(rank, a.chunk)] if per_stage else uniform)(a, virtual, split)

    def transfer_of(rank: int, a: Action) -> float:
        # a plain function of the action charges messages nothing
        return getattr(cost[(rank, a.chunk)] if per_stage else uniform, "transfer", 0.0)
    p = len(plans)
    placement = placement or Placement(p, virtual)
    split = splits_backward(plans)
    release = W if split else B  # the action after which a microbatch's activations are freed
    last_vstage = p * virtual - 1
    clock = [0] * p
    cursor = [0] * p
    busy = [0] * p
    held = [0] * p
    peak = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # (kind, mb, destination vstage) -> arrival time
    sender: dict[tuple[str, int, int], int] = {}  # ... -> index of the send's span
    channel: dict[tuple[int, int], list] = {}      # (sender, receiver) -> what was sent, in order
    taken = Counter()                               # (sender, receiver) -> messages received so far
    last_span: list[int | None] = [None] * p       # each rank's latest span
    done = Counter()
    spans: list[Span] = []

    def message_key(rank: int, a: Action) -> tuple[str, int, int]:
        vs = placement.vstage(rank, a.chunk)
        if a.op == SEND_F:
            return ("act", a.mb, vs + 1)
        if a.op == RECV_F:
            return ("act", a.mb, vs)
        if a.op == SEND_B:
            return ("grad", a.mb, vs - 1)
        return ("grad", a.mb, vs)  # RECV_B

    def run_one(rank: int) -> bool:
        a = plans[rank][cursor[rank]]
        vs = placement.vstage(rank, a.chunk)
        start, after = clock[rank], last_span[rank]
        if a.op in (RECV_F, RECV_B):
            key = message_key(rank, a)
            src, _, what = message(rank, a, placement)
            order = channel.get((src, rank), [])
            if taken[src, rank] < len(order) and order[taken[src, rank]] != what:
                raise ScheduleInvalid(f"rank {rank}: {a} waits for {what} from rank {src}, whose next message to it is "
                                      f"{order[taken[src, rank]]}: messages between two ranks arrive in the order sent")
            if key not in sent:
                return False  # blocked: the message has not been sent yet
            taken[src, rank] += 1
            arrival, sent_by = sent.pop(key), sender.pop(key)
            if arrival > start:
                start, after = arrival, sent_by
        elif a.op in (SEND_F, SEND_B):
            key = message_key(rank, a)
            if not 0 <= key[2] <= last_vstage:
                raise ScheduleInvalid(f"rank {rank}: {a} sends past the ends of the pipeline")
            if placement.rank_of(key[2]) == rank:
                raise ScheduleInvalid(f"rank {rank}: {a} sends to a virtual stage of its own rank")
            if key in sent:
                raise ScheduleInvalid(f"rank {rank}: {a} sent twice")
            sent[key] = start + price(rank, a) + transfer_of(rank, a)
            sender[key] = len(spans)
            src, dst, what = message(rank, a, placement)
            channel.setdefault((src, dst), []).append(what)
        else:
            if a.op == B and done[(F, a.mb, vs)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before the forward of microbatch {a.mb} "
                                      f"on virtual stage {vs}")
            if a.op == W and done[(B, a.mb, vs)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before the B of microbatch {a.mb} on virtual stage {vs}")
            if a.op == F and vs > 0 and done[(F, a.mb, vs - 1)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before its input exists")
            if a.op == B and vs < last_vstage and done[(B, a.mb, vs + 1)] != 1:
                raise ScheduleInvalid(f"rank {rank}: {a} runs before its output gradient exists")
            if done[(a.op, a.mb, vs)]:
                raise ScheduleInvalid(f"rank {rank}: {a} runs twice")
            done[(a.op, a.mb, vs)] += 1
            busy[rank] += price(rank, a)
            held[rank] += 1 if a.op == F else -1 if a.op == release else 0
            peak[rank] = max(peak[rank], held[rank])
        end = start + price(rank, a)
        clock[rank] = end
        last_span[rank] = len(spans)
        spans.append(Span(rank, a, start, end, after))
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
        rank, chunk = placement.location(vs)
        for mb in range(microbatches):
            for op in (F, B, W) if split else (F, B):
                if done[(op, mb, vs)] != 1:
                    raise ScheduleInvalid(f"microbatch {mb} ran {op} {done[(op, mb, vs)]} times "
                                          f"on virtual stage {vs} (rank {rank}, chunk {chunk})")
    if sent:
        raise ScheduleInvalid(f"messages never received: {sorted(sent)}")
    return SimResult(p, microbatches, virtual, max(clock), busy, peak, spans)


def simulate_schedule(name: str, stages: int, microbatches: int, virtual: int = 1,
                      cost: Costs | StageCosts | None = None) -> SimResult:
    """Build schedule `name` and play it on its own placement."""
    plans = build_schedule(name, stages, microbatches, virtual)
    return simulate(plans, microbatches, virtual, cost, schedule_placement(name, stages, virtual))
