"""Run schedules (lists of actions per rank) with given costs, and check them.

The simulator plays every rank's list in order under gloo's rules, the executor's on the CPU: a
send is posted without waiting, a receive waits until its message has been sent, a compute takes
its cost. Given a `posting` (posting.py: how the executor hands the sends and receives to a
backend) it first plays that posting under a backend's `rules` (progress.py; NCCL's: the groups
posted on one communicator run in order, a send completes only once its receive is running), and
a cycle there is a deadlock too, named op by op. It proves, for the lists it is given, that

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
from parallel.pp.posting import posting_plans
from parallel.pp.progress import PlanInvalid, play
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


class Simulation:
    """One play of the lists: where each rank is in its list and its clock, the messages in flight,
    the work done. `play()` runs every rank as far as it can until all are done; one method per
    kind of action, each checking its rules (`receive`, `send`, `compute`); `check_complete()`
    then asks that every microbatch ran everywhere exactly once and every message was received."""

    def __init__(self, plans: list[list[Action]], microbatches: int, virtual: int, cost: Costs | StageCosts | None,
                 placement: Placement | None):
        p = len(plans)
        self.plans, self.microbatches, self.virtual, self.p = plans, microbatches, virtual, p
        self.per_stage = isinstance(cost, Mapping)
        self.cost = cost if self.per_stage else (cost or unit_costs())
        self.placement = placement or Placement(p, virtual)
        self.split = splits_backward(plans)
        self.release = W if self.split else B  # the action after which a microbatch's activations are freed
        self.last_vstage = p * virtual - 1
        self.clock, self.cursor, self.busy = [0] * p, [0] * p, [0] * p
        self.held, self.peak = [0] * p, [0] * p
        self.sent: dict[tuple[str, int, int], float] = {}  # (kind, mb, destination vstage) -> arrival time
        self.sender: dict[tuple[str, int, int], int] = {}  # ... -> index of the send's span
        self.channel: dict[tuple[int, int], list] = {}     # (sender, receiver) -> what was sent, in order
        self.taken = Counter()                              # (sender, receiver) -> messages received so far
        self.last_span: list[int | None] = [None] * p      # each rank's latest span
        self.done = Counter()
        self.spans: list[Span] = []

    def costs_of(self, rank: int, a: Action):
        return self.cost[(rank, a.chunk)] if self.per_stage else self.cost

    def price(self, rank: int, a: Action) -> float:
        return self.costs_of(rank, a)(a, self.virtual, self.split)

    def transfer_of(self, rank: int, a: Action) -> float:
        # a plain function of the action charges messages nothing
        return getattr(self.costs_of(rank, a), "transfer", 0.0)

    def message_key(self, rank: int, a: Action) -> tuple[str, int, int]:
        vs = self.placement.vstage(rank, a.chunk)
        if a.op == SEND_F:
            return ("act", a.mb, vs + 1)
        if a.op == RECV_F:
            return ("act", a.mb, vs)
        if a.op == SEND_B:
            return ("grad", a.mb, vs - 1)
        return ("grad", a.mb, vs)  # RECV_B

    def receive(self, rank: int, a: Action, start: float, after: int | None) -> tuple | None:
        """Take the message `a` waits for: (start, the span waited for), or None while it is unsent."""
        key = self.message_key(rank, a)
        src, _, what = message(rank, a, self.placement)
        order, taken = self.channel.get((src, rank), []), self.taken[src, rank]
        if taken < len(order) and order[taken] != what:
            raise ScheduleInvalid(f"rank {rank}: {a} waits for {what} from rank {src}, whose next message to it is "
                                  f"{order[taken]}: messages between two ranks arrive in the order sent")
        if key not in self.sent:
            return None
        self.taken[src, rank] += 1
        arrival, sent_by = self.sent.pop(key), self.sender.pop(key)
        return (arrival, sent_by) if arrival > start else (start, after)

    def send(self, rank: int, a: Action, start: float) -> None:
        """Post the message: it arrives after the send's cost and its transfer."""
        key = self.message_key(rank, a)
        if not 0 <= key[2] <= self.last_vstage:
            raise ScheduleInvalid(f"rank {rank}: {a} sends past the ends of the pipeline")
        if self.placement.rank_of(key[2]) == rank:
            raise ScheduleInvalid(f"rank {rank}: {a} sends to a virtual stage of its own rank")
        if key in self.sent:
            raise ScheduleInvalid(f"rank {rank}: {a} sent twice")
        self.sent[key] = start + self.price(rank, a) + self.transfer_of(rank, a)
        self.sender[key] = len(self.spans)
        src, dst, what = message(rank, a, self.placement)
        self.channel.setdefault((src, dst), []).append(what)

    def compute(self, rank: int, a: Action) -> None:
        """Run F, B or W once its inputs exist; count the activations the rank holds."""
        vs, done = self.placement.vstage(rank, a.chunk), self.done
        if a.op == B and done[(F, a.mb, vs)] != 1:
            raise ScheduleInvalid(f"rank {rank}: {a} runs before the forward of microbatch {a.mb} "
                                  f"on virtual stage {vs}")
        if a.op == W and done[(B, a.mb, vs)] != 1:
            raise ScheduleInvalid(f"rank {rank}: {a} runs before the B of microbatch {a.mb} on virtual stage {vs}")
        if a.op == F and vs > 0 and done[(F, a.mb, vs - 1)] != 1:
            raise ScheduleInvalid(f"rank {rank}: {a} runs before its input exists")
        if a.op == B and vs < self.last_vstage and done[(B, a.mb, vs + 1)] != 1:
            raise ScheduleInvalid(f"rank {rank}: {a} runs before its output gradient exists")
        if done[(a.op, a.mb, vs)]:
            raise ScheduleInvalid(f"rank {rank}: {a} runs twice")
        done[(a.op, a.mb, vs)] += 1
        self.busy[rank] += self.price(rank, a)
        self.held[rank] += 1 if a.op == F else -1 if a.op == self.release else 0
        self.peak[rank] = max(self.peak[rank], self.held[rank])

    def run_one(self, rank: int) -> bool:
        """Run the rank's next action; False if it is a receive whose message is not sent yet."""
        a = self.plans[rank][self.cursor[rank]]
        start, after = self.clock[rank], self.last_span[rank]
        if a.op in (RECV_F, RECV_B):
            waited = self.receive(rank, a, start, after)
            if waited is None:
                return False
            start, after = waited
        elif a.op in (SEND_F, SEND_B):
            self.send(rank, a, start)
        else:
            self.compute(rank, a)
        end = start + self.price(rank, a)
        self.clock[rank] = end
        self.last_span[rank] = len(self.spans)
        self.spans.append(Span(rank, a, start, end, after))
        self.cursor[rank] += 1
        return True

    def play(self) -> None:
        """Run every rank as far as it can, round after round, until all are done or none can move."""
        plans, cursor = self.plans, self.cursor
        while any(cursor[r] < len(plans[r]) for r in range(self.p)):
            progressed = False
            for r in range(self.p):
                while cursor[r] < len(plans[r]) and self.run_one(r):
                    progressed = True
            if not progressed:
                blocked = {r: str(plans[r][cursor[r]]) for r in range(self.p) if cursor[r] < len(plans[r])}
                raise ScheduleInvalid(f"deadlock: every unfinished rank waits for a message that is never sent: "
                                      f"{blocked}")

    def check_complete(self) -> None:
        for vs in range(self.p * self.virtual):
            rank, chunk = self.placement.location(vs)
            for mb in range(self.microbatches):
                for op in (F, B, W) if self.split else (F, B):
                    if self.done[(op, mb, vs)] != 1:
                        raise ScheduleInvalid(f"microbatch {mb} ran {op} {self.done[(op, mb, vs)]} times "
                                              f"on virtual stage {vs} (rank {rank}, chunk {chunk})")
        if self.sent:
            raise ScheduleInvalid(f"messages never received: {sorted(self.sent)}")

    def result(self) -> SimResult:
        return SimResult(self.p, self.microbatches, self.virtual, max(self.clock), self.busy, self.peak, self.spans)


def simulate(plans: list[list[Action]], microbatches: int, virtual: int = 1, cost: Costs | StageCosts | None = None,
             placement: Placement | None = None, posting: str | None = None, rules: str = "gloo") -> SimResult:
    """Play the lists; `placement` says which rank holds which virtual stage (loop by default).

    `cost` is one Costs for every rank and chunk (the closed forms' assumption: every stage alike),
    or a mapping (rank, chunk) -> Costs for stages that differ (a measured run's: the first stage
    embeds the tokens and the last computes the head and the loss). A mapping's Costs keep the
    meaning of one: a rank's whole share, of which a chunk costs 1/v; a message's transfer is its
    sender's. With a `posting`, the lists as the executor posts them must first finish under
    `rules` ("gloo" or "nccl"); the times are the lists' under gloo's rules (the executor's nccl
    posting adds no wait when messages are free: posting.py)."""
    placement = placement or Placement(len(plans), virtual)
    if posting is not None:
        try:
            deadlock = play(posting_plans(posting, plans, placement), placement, rules)
        except PlanInvalid as e:
            raise ScheduleInvalid(str(e)) from None
        if deadlock is not None:
            raise ScheduleInvalid(f"deadlock with the {posting} posting: {deadlock}")
    simulation = Simulation(plans, microbatches, virtual, cost, placement)
    simulation.play()
    simulation.check_complete()
    return simulation.result()


def simulate_schedule(name: str, stages: int, microbatches: int, virtual: int = 1,
                      cost: Costs | StageCosts | None = None, posting: str | None = None,
                      rules: str = "gloo") -> SimResult:
    """Build schedule `name` and play it on its own placement (and, given a posting, under `rules`)."""
    plans = build_schedule(name, stages, microbatches, virtual)
    return simulate(plans, microbatches, virtual, cost, schedule_placement(name, stages, virtual), posting, rules)
