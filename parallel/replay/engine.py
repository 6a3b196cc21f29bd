"""The replay engine: a small discrete-event simulator that plays every rank's step at once.

Each rank's step is a program, a list of tasks in the order the rank ran them (graph.py builds
them from the saved events; tests build them by hand):

    Compute(seconds, phase)       the rank computes; alone on a core it takes `seconds`
    Call(op)                      a blocking collective or send/receive: the rank waits for it
    Post(op, handle)              an async one: the rank goes on; `handle` names it for its wait
    Wait(handles)                 the rank blocks until every op it names has completed

An `Op` is one collective (or one message) as all its members see it: the members that must post
it, the links it loads and for how long. The rules:

* an op starts when its last member has posted it (a message: when both ends have); a group's
  collectives start in the order they were posted, `lanes` of them in flight at most (gloo runs
  two at once, NCCL one; messages are not queued behind collectives);
* it first waits its latency (`latency_s`: per-step latency x the algorithm's steps), then moves
  its bytes: `demand[link]` bytes over each link it loads; a link's bandwidth is shared equally
  by the ops moving bytes over it at the same moment, and an op progresses at the pace of its
  most loaded link (a ring is as fast as its slowest edge);
* a link may have a token bucket (`buckets[link] = (burst bytes, line bytes/s)`: an emulated
  link's tbf). While the bucket holds tokens the link carries `line` bytes/s, and the bucket
  drains by what it carries beyond the link's rate; empty, the link carries its rate. It refills
  at the rate by what the link leaves unused, up to `burst`, and starts the step full;
* an op alone lasts at least the CPU it took of its busiest member (`Op.cpu`, below): a member's
  threads share its core, so where the run measured more CPU than the latency and transfer take,
  the op was CPU-bound and the surplus lengthens its latency (`cpu_beyond_links`);
* every member's view of the op completes when the op does: a receive at the later of the two
  posts plus the transfer; a blocking call, or a wait, returns then.

Every rank's compute and its communication share cores (processor sharing, `paces`): a rank
computing wants a core, an op in flight wants of each member the CPU the run measured it took
(`Op.cpu`, graph.py) spread over its time alone on its links (`cpu_share`; nothing without
`cpu`: a device with its own copy engine), and a rank blocked in a call or a wait leaves its
core to its ops. Where a core is wanted more than it has, each goes at 1 / wanted of it, an op
at the pace of its slowest member. The cores are one per rank (`cores=None`), the core each rank
is bound to (`cores=[core of rank 0, ...]`: `train.pin_cores=round_robin`, several ranks to a
core), or C cores shared by ranks whose threads the kernel moves freely (`cores=C`): there a
member of an op in flight wants a whole core, since its threads wait for one at every handoff
(an upper bound on what it needs). Nothing is fitted.

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
    lanes: int = 1  # how many ops of its queue may be in flight at once
    # CPU seconds the op took of each member (its gloo threads, and its calling thread inside the
    # call), measured in the run (graph.communication_cpu); None: not known
    cpu: dict | None = None
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
TOKEN_EPS = 1e-6  # bytes: a bucket holding less than this is empty


class Replay:
    """One replay's state: where each rank is in its program, what it waits for, the ops in flight.

    `run()` below drives it: everything that can happen at one instant (`settle`), then time moves
    to the next event (`advance`)."""

    def __init__(self, programs: list[list], bandwidth: dict, cores: float | list | None,
                 buckets: dict | None = None):
        n = len(programs)
        if isinstance(cores, (list, tuple)) and len(cores) != n:
            raise ValueError(f"cores: a placement names the core of each of the {n} ranks, got {len(cores)}")
        self.programs, self.bandwidth, self.cores, self.n = programs, bandwidth, cores, n
        self.buckets = buckets or {}  # link -> (burst bytes, line bytes/s)
        self.tokens = {link: float(burst) for link, (burst, _) in self.buckets.items()}
        self.pc = [0] * n  # the next task of each rank
        self.remaining = [0.0] * n  # compute seconds left (at one core's pace) of the current task
        self.computing: list[Compute | None] = [None] * n
        self.blocked: list[tuple | None] = [None] * n  # (ops, since, name, category, phase) the rank waits for
        self.handles: list[dict] = [{} for _ in range(n)]
        self.began = [0.0] * n
        self.ends = [math.nan] * n
        self.intervals: list[Interval] = []
        self.ops: dict[tuple, Op] = {}
        self.queues: dict[tuple, list[Op]] = {}  # queue -> its ops not started, in posting order of their first member
        self.active: list[Op] = []  # started, not complete
        self.left: dict[tuple, float] = {}  # op key -> latency seconds left, then ("bytes" phase) fraction left
        self.phase_of: dict[tuple, str] = {}
        self.shares: dict[tuple, dict] = {}  # op key -> {member: share of a core it wants in flight}
        self.t = 0.0

    # -- what happens at one instant ---------------------------------------------------------------
    def register(self, op: Op, rank: int) -> Op:
        """`rank` posts `op` now (the first member's post puts it in its group's queue)."""
        op = self.ops.setdefault(op.key, op)
        if rank in op.posted:
            raise ValueError(f"rank {rank} posted {op.name or op.key} twice")
        op.posted[rank] = self.t
        if op.queue is not None and len(op.posted) == 1:
            self.queues.setdefault(op.queue, []).append(op)
        return op

    def try_start(self) -> bool:
        """Start every op whose members have all posted it and whose group's queue lets it go."""
        started = False
        for op in list(self.ops.values()):
            if op.start is not None or len(op.posted) < len(op.members):
                continue
            if op.queue is not None:
                queue = self.queues[op.queue]
                in_flight = sum(o.queue == op.queue for o in self.active)
                if queue[0] is not op or in_flight >= op.lanes:
                    continue
                queue.pop(0)
            op.start = self.t
            self.phase_of[op.key], self.left[op.key] = "latency", op.latency_s + self.cpu_beyond_links(op)
            self.active.append(op)
            started = True
        return started

    def settle_ops(self) -> bool:
        """Latencies that have elapsed turn into transfers; transfers that are done (or of nothing) complete."""
        moved = False
        for op in list(self.active):
            if self.phase_of[op.key] == "latency" and self.left[op.key] <= EPS:
                self.phase_of[op.key], self.left[op.key] = "bytes", 1.0
                moved = True
            if self.phase_of[op.key] == "bytes" and (self.left[op.key] <= EPS or not any(op.demand.values())):
                op.end = self.t
                self.active.remove(op)
                moved = True
        return moved

    def advance_rank(self, r: int) -> bool:
        """Take rank r through every task it can finish or begin now; True if anything changed."""
        moved, t = False, self.t
        while True:
            if self.computing[r] is not None:
                if self.remaining[r] > EPS:
                    return moved
                task = self.computing[r]
                self.intervals.append(Interval(r, "compute", task.phase, task.phase, self.began[r], t, task.label))
                self.computing[r] = None
                moved = True
            if self.blocked[r] is not None:
                waiting, since, name, category, phase = self.blocked[r]
                if any(op.end is None for op in waiting):
                    return moved
                self.intervals.append(Interval(r, "blocked", name, category, since, t, phase, op=waiting[0]))
                self.blocked[r] = None
                moved = True
            if self.pc[r] >= len(self.programs[r]):
                if math.isnan(self.ends[r]):
                    self.ends[r] = t
                    moved = True
                return moved
            task = self.programs[r][self.pc[r]]
            self.pc[r] += 1
            moved = True
            self.begin(r, task)

    def begin(self, r: int, task) -> None:
        """Rank r starts `task`: compute, block on a call, post (and go on), or block on a wait."""
        t = self.t
        if isinstance(task, Compute):
            if task.seconds > 0:
                self.computing[r], self.remaining[r], self.began[r] = task, task.seconds, t
        elif isinstance(task, Call):
            op = self.register(task.op, r)
            self.blocked[r] = ((op,), t, op.name, op.category, task.phase)
        elif isinstance(task, Post):
            op = self.register(task.op, r)
            self.intervals.append(Interval(r, "post", op.name, op.category, t, t, task.phase, op=op))
            self.handles[r][task.handle] = op
        elif isinstance(task, Wait):
            waiting = tuple(self.handles[r].pop(h) for h in task.handles if h in self.handles[r])
            if waiting:
                self.blocked[r] = (waiting, t, task.name or waiting[0].name, waiting[0].category, task.phase)
        else:
            raise TypeError(f"not a task: {task!r}")

    def settle(self) -> None:
        """Everything that happens at this instant, until nothing more does."""
        moved = True
        while moved:
            moved = False
            for r in range(self.n):
                moved |= self.advance_rank(r)
            moved |= self.try_start()
            moved |= self.settle_ops()

    @property
    def done(self) -> bool:
        return all(not math.isnan(e) for e in self.ends)

    # -- time moving to the next event -------------------------------------------------------------
    def capacity(self, link) -> float:
        """Bytes/s the link carries now: its line rate while its bucket holds tokens, else its rate."""
        if link in self.buckets and self.tokens[link] > TOKEN_EPS:
            return self.buckets[link][1]
        return self.bandwidth[link]

    def nominal_s(self, op: Op) -> float:
        """How long the op takes alone on its links: its latency and its bytes at the links' rates."""
        moves = [nbytes / self.bandwidth[link] for link, nbytes in op.demand.items() if nbytes > 0]
        return op.latency_s + (max(moves) if moves else 0.0)

    def cpu_beyond_links(self, op: Op) -> float:
        """How much longer than its latency and transfer the op's busiest member spent CPU on it.

        An op alone lasts at least the CPU it took of each member: a member's threads (gloo's, and
        the calling thread inside the call) share one core, so their work is done one after the
        other. Where the run measured more CPU than the link model's time, the op is CPU-bound and
        the surplus is added to its latency (a phase that loads no link). 0 where its CPU was not
        measured (a what-if on a cluster, `comm_cpu=free`, a run saved without the clock)."""
        if not op.cpu:
            return 0.0
        return max(0.0, max(op.cpu.values()) - self.nominal_s(op))

    def cpu_share(self, op: Op, rank: int) -> float:
        """The share of a core the op wants of a member while in flight: the CPU it took of that
        member spread over its time alone (its links' time, or its busiest member's CPU where that
        is longer: `cpu_beyond_links`), so at most one core; 0 where not measured."""
        if op.cpu is None:
            return 0.0
        if op.key not in self.shares:
            nominal = self.nominal_s(op) + self.cpu_beyond_links(op)
            self.shares[op.key] = {m: min(1.0, c / nominal) if nominal > 0 else 0.0 for m, c in op.cpu.items()}
        return self.shares[op.key].get(rank, 0.0)

    def paces(self) -> tuple[list[float], dict]:
        """Processor sharing: the pace of each rank's compute and of each op in flight.

        Ranks placed on cores (`cores=None`, a core per rank, or a list: each rank's core): a
        rank's communication wants the sum of its ops' measured shares (`cpu_share`; nothing for an
        op without a measurement: a run saved before the other threads' clock replays as before
        it), at most one core; its compute wants a core. Everything the ranks of one core want
        shares that core: when they want more than it, each goes at 1 / wanted. An op goes at the
        pace of its slowest member.

        `cores=C` shared by all ranks: every computing rank wants a core, and so does every rank
        with an op in flight, whatever the op's measured CPU: on a machine whose cores are all
        busy an op's progress waits for its threads to get a core at each handoff, a latency its
        CPU time does not show. All go at min(1, C / wanted)."""
        computing = [1.0 if self.computing[r] is not None else 0.0 for r in range(self.n)]
        communicating = [0.0] * self.n  # what each rank's ops in flight want, at most a core
        pooled = self.cores is not None and not isinstance(self.cores, (list, tuple))
        for op in self.active:
            for m in op.members:
                share = 1.0 if pooled else self.cpu_share(op, m)
                communicating[m] = min(1.0, communicating[m] + share)
        if not pooled:
            placement = range(self.n) if self.cores is None else self.cores
            wanted: dict = {}
            for r, core in enumerate(placement):
                wanted[core] = wanted.get(core, 0.0) + computing[r] + communicating[r]
            rank_pace = [1.0 / max(1.0, wanted[core]) for core in placement]
            return rank_pace, {op.key: min(rank_pace[m] for m in op.members) for op in self.active}
        wanted_all = sum(computing) + sum(communicating)
        pace = min(1.0, self.cores / wanted_all) if wanted_all > 0 else 1.0
        return [pace] * self.n, {op.key: pace for op in self.active}

    def rates(self) -> tuple[list[int], list[float], dict, dict, dict]:
        """The ranks computing, the pace of each rank's compute and of each op (`paces`), each
        transfer's rate (the fraction of its bytes per second): its share of each link it loads
        (equal shares), at the pace of its most loaded link, times the op's pace; and the bytes/s
        each bucketed link carries."""
        busy = [r for r in range(self.n) if self.computing[r] is not None]
        pace, op_pace = self.paces()
        moving = [op for op in self.active if self.phase_of[op.key] == "bytes"]
        load: dict = {}
        for op in moving:
            for link, nbytes in op.demand.items():
                if nbytes > 0:
                    load[link] = load.get(link, 0) + 1
        rate = {op.key: op_pace[op.key] * min(self.capacity(link) / load[link] / nbytes
                                              for link, nbytes in op.demand.items() if nbytes > 0) for op in moving}
        flow = dict.fromkeys(self.buckets, 0.0)
        for op in moving:
            for link, nbytes in op.demand.items():
                if link in flow:
                    flow[link] += rate[op.key] * nbytes
        return busy, pace, op_pace, rate, flow

    def advance(self) -> None:
        """Move time to the next event: a compute finishing, a latency elapsing, a transfer ending
        or a bucket running dry."""
        busy, pace, op_pace, rate, flow = self.rates()
        steps = [self.remaining[r] / pace[r] for r in busy]
        steps += [self.left[op.key] / rate[op.key] if op.key in rate else self.left[op.key] / op_pace[op.key]
                  for op in self.active]
        drain = {link: flow[link] - self.bandwidth[link] for link in self.buckets}
        steps += [self.tokens[link] / drain[link] for link in self.buckets
                  if self.tokens[link] > TOKEN_EPS and drain[link] > 0]
        if not steps:
            stuck = {r: repr(self.programs[r][self.pc[r] - 1]) for r in range(self.n) if math.isnan(self.ends[r])}
            raise Deadlock(f"deadlock at t={self.t:.6f}s: every unfinished rank waits for an op a member never "
                           f"posts: {stuck}")
        dt = min(steps)
        self.t += dt
        for link, (burst, _) in self.buckets.items():
            tokens = min(float(burst), self.tokens[link] - drain[link] * dt)
            self.tokens[link] = tokens if tokens > TOKEN_EPS else 0.0
        for r in busy:
            self.remaining[r] = 0.0 if self.remaining[r] / pace[r] <= dt else self.remaining[r] - dt * pace[r]
        for op in self.active:
            key, speed = op.key, rate.get(op.key, op_pace[op.key])  # bytes, or its latency at its pace
            self.left[key] = 0.0 if self.left[key] / speed <= dt else self.left[key] - dt * speed


def run(programs: list[list], bandwidth: dict | None = None, cores: float | list | None = None,
        buckets: dict | None = None) -> Result:
    """Play `programs` (one per rank) together; `bandwidth[link]`: bytes/s of each link an op
    loads; `cores`: None for a core per rank, a list for the core each rank is bound to (ranks
    of one core share it), else how many cores all ranks share; `buckets[link]`:
    (burst bytes, line bytes/s) of a link's token bucket."""
    play = Replay(programs, bandwidth or {}, cores, buckets)
    play.settle()
    while not play.done:
        play.advance()
        play.settle()
    unmatched = [op for op in play.ops.values() if op.end is None]
    if unmatched:
        raise Deadlock(f"ops never completed: {[op.name or op.key for op in unmatched][:5]}")
    return Result(play.ends, play.intervals, list(play.ops.values()))
