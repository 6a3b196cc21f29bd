"""Whether a posting plan finishes under a backend's rules, and if not, the cycle that stops it.

The executor posts a rank's sends and receives as its posting plan says (posting.py). Whether every
rank reaches the end depends on how the backend runs what was posted:

    gloo   an op runs as soon as it is posted; a send completes at once (its bytes are handed to
           gloo's threads), a receive once its message has been sent.
    nccl   the groups a rank posts on one communicator run in the order posted, one after the
           other (one stream per communicator): a group starts once the previous one on that
           communicator has completed, and its ops are then active. A send and its receive complete
           together, once both are active (a send completes only when its receive is running:
           NVIDIA/nccl#783). A group completes when all its ops have, and it is one work: waiting for
           any op of it waits for all of them (torch's batch_isend_irecv coalesces on NCCL).

Messages are matched per communicator, per (sender, receiver), in posting order: the k-th send
from a to b on a communicator meets the k-th receive b posts from a there, and both must be about
the same message (else the plan is wrong whatever the backend).

`play` runs every rank as far as it can: computes and posts never block, a Wait blocks until its
ops (on NCCL, their groups) are complete. When no rank can move and some are not done, the plan is
stuck, and `Deadlock.cycle` follows what each blocked op waits for (the group before it on its
communicator, or its match on the peer, or the peer itself where it has not posted the match yet)
from the lowest blocked rank until it comes back to an op already seen: the first cycle.
Nothing is timed here: the simulator (simulator.py) times the lists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from parallel.pp.actions import Action, message
from parallel.pp.placement import Placement
from parallel.pp.posting import SENDS, Post, Step, Wait, posting_plans
from parallel.pp.schedules import built_schedule, schedule_placement

RULES = ("gloo", "nccl")


class PlanInvalid(ValueError):
    """A posting plan that is wrong under any rules: a receive matched with another message, a wait
    for an op never posted."""


class Op:
    """One send or receive as posted: where it is matched (`line`: channel, sender, receiver) and
    its place there, the message it is about, its group, and whether it is active and done."""

    __slots__ = ("rank", "action", "line", "what", "group", "index", "sends", "active", "done")

    def __init__(self, rank: int, action: Action, line: tuple, what: tuple, group: Group):
        self.rank, self.action, self.line, self.what, self.group = rank, action, line, what, group
        self.sends = action.op in SENDS
        self.index, self.active, self.done = 0, False, False

    def __str__(self) -> str:
        return f"rank {self.rank} {self.action}"


class Group:
    """One Post: its ops, and how many of them are not complete yet."""

    __slots__ = ("rank", "channel", "ops", "pending")

    def __init__(self, rank: int, channel):
        self.rank, self.channel, self.ops, self.pending = rank, channel, [], 0

    @property
    def done(self) -> bool:
        return self.pending == 0


@dataclass(frozen=True)
class Deadlock:
    rules: str
    cycle: tuple[tuple[Op, str], ...]  # each op of the cycle and why it waits for the next

    @property
    def ranks(self) -> list[int]:
        return sorted({op.rank for op, _ in self.cycle})

    @property
    def blocked(self) -> list[str]:
        return [str(op) for op, _ in self.cycle]

    def __str__(self) -> str:
        steps = "; ".join(f"{op} {why}" for op, why in self.cycle)
        return f"a cycle under {self.rules}'s rules: {steps}"


class Play:
    """One play of every rank's posting plan under `rules` (the module docstring)."""

    def __init__(self, steps: list[list[Step]], placement: Placement, rules: str):
        if rules not in RULES:
            raise ValueError(f"rules {rules!r}: choose one of {', '.join(RULES)}")
        self.steps, self.placement, self.nccl = steps, placement, rules == "nccl"
        self.rules = rules
        self.cursor = [0] * len(steps)
        self.ops: list[dict[Action, Op]] = [{} for _ in steps]  # each rank's posted ops
        self.queues: dict[tuple, deque] = {}   # (rank, channel) -> its groups not complete, oldest first
        self.lines: dict[tuple, list[list[Op]]] = {}  # line -> [sends, receives] in posting order
        self.woken: deque = deque(range(len(steps)))
        self.starting: deque = deque()  # groups whose turn has come, to start (a loop, not recursion)

    # -- posting and completing --------------------------------------------------------------------
    def post(self, rank: int, step: Post) -> None:
        group, lines = Group(rank, step.channel), self.lines
        for a in step.actions:
            src, dst, what = message(rank, a, self.placement)
            line = (step.channel, src, dst)
            op = Op(rank, a, line, what, group)
            if line not in lines:
                lines[line] = ([], [])
            sends, receives = lines[line]
            mine, theirs = (sends, receives) if op.sends else (receives, sends)
            op.index = len(mine)
            mine.append(op)
            if op.index < len(theirs) and theirs[op.index].what != what:
                raise PlanInvalid(f"{op} is matched with {theirs[op.index]}, another message: messages between "
                                  "two ranks are matched in the order they were posted")
            group.ops.append(op)
            self.ops[rank][a] = op
        group.pending = len(group.ops)
        key = (rank, step.channel)
        if key not in self.queues:
            self.queues[key] = deque()
        queue = self.queues[key]
        queue.append(group)
        if not self.nccl or len(queue) == 1:
            self.starting.append(group)
        while self.starting:
            self.start(self.starting.popleft())

    def match(self, op: Op) -> Op | None:
        sends, receives = self.lines[op.line]
        theirs = receives if op.sends else sends
        return theirs[op.index] if op.index < len(theirs) else None

    def start(self, group: Group) -> None:
        """Its ops are active: each completes now if the rules let it (module docstring)."""
        for op in group.ops:
            op.active = True
        for op in group.ops:
            match = self.match(op)
            if self.nccl or not op.sends:
                if match is not None and match.active:
                    self.complete(op)
                    self.complete(match)
            else:
                self.complete(op)  # gloo: a send completes at once, and so does its receive if posted
                if match is not None and match.active:
                    self.complete(match)

    def complete(self, op: Op) -> None:
        if op.done:
            return
        op.done = True
        self.woken.append(op.rank)
        group = op.group
        group.pending -= 1
        if group.pending:
            return
        queue = self.queues[group.rank, group.channel]
        queue.remove(group)
        if self.nccl and queue:
            self.starting.append(queue[0])

    # -- the ranks ---------------------------------------------------------------------------------
    def waits_for(self, rank: int, step: Wait) -> list[Op]:
        """The ops of `step` not complete yet (on NCCL: not in a complete group)."""
        posted = self.ops[rank]
        for a in step.actions:
            if a not in posted:
                raise PlanInvalid(f"rank {rank} waits for {a}, which it has not posted")
        ops = [posted[a] for a in step.actions]
        return [op for op in ops if op.group.pending] if self.nccl else [op for op in ops if not op.done]

    def advance(self, rank: int) -> None:
        steps, cursor = self.steps[rank], self.cursor
        while cursor[rank] < len(steps):
            step = steps[cursor[rank]]
            if type(step) is Wait and self.waits_for(rank, step):
                return
            if type(step) is Post:
                self.post(rank, step)
            cursor[rank] += 1

    def run(self) -> Deadlock | None:
        while self.woken:
            self.advance(self.woken.popleft())
        stuck = [r for r in range(len(self.steps)) if self.cursor[r] < len(self.steps[r])]
        return Deadlock(self.rules, self.first_cycle(stuck[0])) if stuck else None

    # -- the cycle ---------------------------------------------------------------------------------
    def blocking(self, rank: int) -> Op:
        """The first op a blocked rank's Wait is held up by (on NCCL: the first op not complete in
        the first group not complete)."""
        op = self.waits_for(rank, self.steps[rank][self.cursor[rank]])[0]
        return next(o for o in op.group.ops if not o.done) if self.nccl else op

    def next_in_chain(self, op: Op) -> tuple[Op, str]:
        """What `op` waits for, and the words for it."""
        if not op.active:
            ahead = self.queues[op.rank, op.group.channel][0]
            first = next(o for o in ahead.ops if not o.done)
            return first, f"is queued behind {first.action} on the same communicator"
        match = self.match(op)
        peer = op.line[2] if op.sends else op.line[1]
        if match is None:
            if self.cursor[peer] >= len(self.steps[peer]):
                raise PlanInvalid(f"{op} waits for a message rank {peer} never posts")
            blocker = self.blocking(peer)
            kind = "receive" if op.sends else "send"
            return blocker, (f"needs rank {peer} to post the matching {kind}, but rank {peer} is blocked "
                             f"waiting for {blocker.action}")
        return match, f"needs rank {peer}'s matching {match.action}, which is not running yet"

    def first_cycle(self, rank: int) -> tuple[tuple[Op, str], ...]:
        chain, seen = [], {}
        op = self.blocking(rank)
        while op not in seen:
            seen[op] = len(chain)
            following, why = self.next_in_chain(op)
            chain.append((op, why))
            op = following
        return tuple(chain[seen[op]:])


def play(steps: list[list[Step]], placement: Placement, rules: str) -> Deadlock | None:
    """Play every rank's posting plan under `rules`: None if all finish, else the first cycle."""
    return Play(steps, placement, rules).run()


@lru_cache(maxsize=1024)
def schedule_deadlock(name: str, stages: int, microbatches: int, virtual: int, posting: str,
                      rules: str) -> Deadlock | None:
    """Schedule `name` as the executor posts it with `posting`, played under `rules` (cached: the run
    validator asks it for every plan it checks)."""
    placement = schedule_placement(name, stages, virtual)
    plans = [list(actions) for actions in built_schedule(name, stages, microbatches, virtual)]
    return play(posting_plans(posting, plans, placement), placement, rules)
