"""The replay engine: a small discrete-event simulator that plays every rank's step at once.

Each rank's step is a program, a list of tasks in the order the rank ran them (graph.py builds
them from the saved events; tests build them by hand):

    Compute(seconds, phase)       the rank computes; alone on a core it takes `seconds`
    Call(op)                      a blocking collective or send/receive: the rank waits for it
    Post(op, handle)              an async one: the rank goes on; `handle` names it for its wait
    Wait(handles)                 the rank blocks until every op it names has completed

An `Op` is one collective (or one message) as all its members see it: the members that must post
it, the links it loads and for how long. The rules, those of the issue that asked for this engine:

* an op starts when its last member has posted it (a message: when both ends have), and not
  before the previous collective of its group has completed (a group's collectives run in order;
  messages are not queued behind collectives);
* it first waits its latency (`latency_s`: per-step latency x the algorithm's steps), then moves
  its bytes: `demand[link]` bytes over each link it loads; a link's bandwidth is shared equally
  by the ops moving bytes over it at the same moment, and an op progresses at the pace of its
  most loaded link (a ring is as fast as its slowest edge);
* every member's view of the op completes when the op does: a receive at the later of the two
  posts plus the transfer; a blocking call, or a wait, returns then.

Compute runs at one core's pace per rank (`cores=None`: a device per rank), or, to reproduce a
machine with fewer cores than ranks, by processor sharing: the ranks computing at one moment each
progress at min(1, cores / computing) of a core (a rank blocked in a wait uses none).

Time advances from one event (a compute finishing, a latency elapsing, a transfer ending) to the
next; everything that can happen at an instant happens before time moves. Nothing here knows
what a pipeline or a gradient is: the answers depend only on the programs and the ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Op:
    """One collective or message: who must post it, its group's queue, its latency and its bytes."""

    key: tuple
    members: tuple[int, ...]
    name: str = ""  # what it is, for the trace ("all_reduce dp grads/bucket0")
    category: str = "exposed_comm"  # what a rank blocked on it is doing: exposed_comm or bubble
    queue: tuple | None = None  # ops of one queue start in order (a group's collectives); None: no queue
    latency_s: float = 0.0
    demand: dict = field(default_factory=dict)  # link -> bytes moved over it
    # filled in by the run
    posted: dict = field(default_factory=dict)  # rank -> time
    start: float | None = None
    end: float | None = None


@dataclass
class Compute:
    seconds: float
    phase: str = "compute"
    label: str = ""


@dataclass
class Call:
    op: Op
    phase: str = ""  # the phase the rank was in (the trace draws the wait inside it)


@dataclass
class Post:
    op: Op
    handle: object = None
    phase: str = ""


@dataclass
class Wait:
    handles: tuple
    name: str = ""
    phase: str = ""


@dataclass
class Interval:
    """What a rank did from `start` to `end`: computed (a phase) or was blocked (on an op)."""

    rank: int
    kind: str  # "compute" | "blocked" | "post"
    name: str  # the phase, or the op's name
    category: str  # compute phases: the phase; blocked: exposed_comm or bubble
    start: float
    end: float
    label: str = ""  # a compute's label; a blocked interval's or a post's: the phase it fell in
    op: Op | None = None


@dataclass
class Result:
    ends: list[float]  # when each rank finished its program
    intervals: list[Interval]
    ops: list[Op]

    @property
    def step_s(self) -> float:
        return max(self.ends) if self.ends else 0.0

    def busy(self, rank: int) -> float:
        return sum(i.end - i.start for i in self.intervals if i.rank == rank and i.kind == "compute")


class Deadlock(RuntimeError):
    """No rank can move: every unfinished one waits for an op a member never posts."""


EPS = 1e-12


def run(programs: list[list], bandwidth: dict | None = None, cores: float | None = None) -> Result:
    """Play `programs` (one per rank) together; `bandwidth[link]`: bytes/s of each link an op
    loads; `cores`: None for a core per rank, else the cores the ranks share."""
    bandwidth = bandwidth or {}
    n = len(programs)
    pc = [0] * n
    remaining = [0.0] * n  # compute seconds left (at one core's pace) of the current task
    computing: list[Compute | None] = [None] * n
    blocked: list[tuple | None] = [None] * n  # (ops, since, name, category) the rank waits for
    handles: list[dict] = [{} for _ in range(n)]
    began = [0.0] * n
    ends = [math.nan] * n
    intervals: list[Interval] = []
    ops: dict[tuple, Op] = {}
    queues: dict[tuple, list[Op]] = {}  # queue -> its ops not yet started, in posting order of their first member
    active: list[Op] = []  # started, not complete
    left: dict[tuple, float] = {}  # op key -> latency seconds left, then ("bytes" phase) fraction left
    phase_of: dict[tuple, str] = {}
    t = 0.0

    def register(op: Op, rank: int) -> Op:
        op = ops.setdefault(op.key, op)
        if rank in op.posted:
            raise ValueError(f"rank {rank} posted {op.name or op.key} twice")
        op.posted[rank] = t
        if op.queue is not None and len(op.posted) == 1:
            queues.setdefault(op.queue, []).append(op)
        return op

    def try_start() -> bool:
        started = False
        for op in list(ops.values()):
            if op.start is not None or len(op.posted) < len(op.members):
                continue
            if op.queue is not None:
                queue = queues[op.queue]
                if queue[0] is not op or any(o.queue == op.queue for o in active):
                    continue
                queue.pop(0)
            op.start = t
            phase_of[op.key] = "latency"
            left[op.key] = op.latency_s
            active.append(op)
            started = True
        return started

    def settle_ops() -> bool:
        """Latencies that have elapsed turn into transfers; transfers of nothing complete."""
        moved = False
        for op in list(active):
            if phase_of[op.key] == "latency" and left[op.key] <= EPS:
                phase_of[op.key], left[op.key] = "bytes", 1.0
                moved = True
            if phase_of[op.key] == "bytes" and (left[op.key] <= EPS or not any(op.demand.values())):
                op.end = t
                active.remove(op)
                moved = True
        return moved

    def advance_rank(r: int) -> bool:
        moved = False
        while True:
            if computing[r] is not None:
                if remaining[r] > EPS:
                    return moved
                task = computing[r]
                intervals.append(Interval(r, "compute", task.phase, task.phase, began[r], t, task.label))
                computing[r] = None
                moved = True
            if blocked[r] is not None:
                waiting, since, name, category, phase = blocked[r]
                if any(op.end is None for op in waiting):
                    return moved
                intervals.append(Interval(r, "blocked", name, category, since, t, phase, op=waiting[0]))
                blocked[r] = None
                moved = True
            if pc[r] >= len(programs[r]):
                if math.isnan(ends[r]):
                    ends[r] = t
                    moved = True
                return moved
            task = programs[r][pc[r]]
            pc[r] += 1
            moved = True
            if isinstance(task, Compute):
                if task.seconds > 0:
                    computing[r], remaining[r], began[r] = task, task.seconds, t
            elif isinstance(task, Call):
                op = register(task.op, r)
                blocked[r] = ((op,), t, op.name, op.category, task.phase)
            elif isinstance(task, Post):
                op = register(task.op, r)
                intervals.append(Interval(r, "post", op.name, op.category, t, t, task.phase, op=op))
                handles[r][task.handle] = op
            elif isinstance(task, Wait):
                waiting = tuple(handles[r].pop(h) for h in task.handles if h in handles[r])
                if waiting:
                    blocked[r] = (waiting, t, task.name or waiting[0].name, waiting[0].category, task.phase)
            else:
                raise TypeError(f"not a task: {task!r}")

    while True:
        moved = True
        while moved:  # everything that happens at this instant
            moved = False
            for r in range(n):
                moved |= advance_rank(r)
            moved |= try_start()
            moved |= settle_ops()
        if all(not math.isnan(e) for e in ends):
            break
        # Rates: compute by processor sharing, bytes by equal shares of each link.
        busy = [r for r in range(n) if computing[r] is not None]
        pace = 1.0 if cores is None or not busy else min(1.0, cores / len(busy))
        load: dict = {}
        for op in active:
            if phase_of[op.key] == "bytes":
                for link, nbytes in op.demand.items():
                    if nbytes > 0:
                        load[link] = load.get(link, 0) + 1
        rate: dict[tuple, float] = {}
        for op in active:
            if phase_of[op.key] == "bytes":
                rate[op.key] = min(bandwidth[link] / load[link] / nbytes
                                   for link, nbytes in op.demand.items() if nbytes > 0)
        steps = [remaining[r] / pace for r in busy]
        steps += [left[op.key] / rate[op.key] if phase_of[op.key] == "bytes" else left[op.key] for op in active]
        if not steps:
            stuck = {r: repr(programs[r][pc[r] - 1]) for r in range(n) if math.isnan(ends[r])}
            raise Deadlock(f"deadlock at t={t:.6f}s: every unfinished rank waits for an op a member never posts: "
                           f"{stuck}")
        dt = min(steps)
        t += dt
        for r in busy:
            remaining[r] = 0.0 if remaining[r] / pace <= dt else remaining[r] - dt * pace
        for op in active:
            if phase_of[op.key] == "bytes":
                left[op.key] = 0.0 if left[op.key] / rate[op.key] <= dt else left[op.key] - dt * rate[op.key]
            else:
                left[op.key] = max(0.0, left[op.key] - dt)
    unmatched = [op for op in ops.values() if op.end is None]
    if unmatched:
        raise Deadlock(f"ops never completed: {[op.name or op.key for op in unmatched][:5]}")
    return Result(ends, intervals, list(ops.values()))
