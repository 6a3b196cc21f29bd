"""Which rank a hang starts at, read from every rank's flight-recorder dump (parallel/dist/flight.py).

A dump says which call a rank is blocked in (or the one that failed, when its timeout fired), and
the last number it posted on each channel. For every blocked rank, the members of its call that
never posted it are the ones it waits for:

    a collective's missing members   the group's ranks whose count on the group is below the call's
                                     number (a rank with no dump cannot say: it counts as missing)
    a receive's (or send's)          the peer, if its sends to this rank (its receives from it) on
                                     that group stop short of the number

That makes a graph, waiter -> missing. A missing rank that is itself blocked (in a call of another
group, waiting for a third rank) is not the cause: the cause is a rank the edges lead to that waits
in no call at all (it computes, sleeps, or is stuck outside communication), or left no dump. The
verdict names those ranks with the calls they never posted, by group and number, and the waits that
chain behind them. Blocked ranks whose calls every member posted, or waits that go round in a
cycle, are said as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.dist.flight import channel


@dataclass
class Wait:
    """One call some ranks are blocked in, and the members that never posted it."""

    op: str
    group: str
    ranks: list[int]
    seq: int
    src: int | None
    dst: int | None
    waiters: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)

    def named(self, missing_side: bool = False) -> str:
        """The call as the waiters posted it, or as the missing side would have: a send for a receive."""
        if self.src is None:
            return f"{self.op} #{self.seq} of group {self.group} (ranks {self.ranks})"
        op = {"recv": "send", "send": "recv"}.get(self.op, self.op) if missing_side else self.op
        return f"{op} {self.src}->{self.dst} #{self.seq} of group {self.group} (ranks {self.ranks})"


@dataclass
class Verdict:
    line: str
    culprits: list[int]  # the ranks the hang starts at
    waits: list[Wait]

    def as_dict(self) -> dict:
        return {"verdict": self.line, "culprits": self.culprits,
                "waits": [vars(w) for w in self.waits]}


def _members_missing(record: dict, me: int, dumps: dict[int, dict]) -> list[int]:
    key = channel(record["group"], record["ranks"], record["src"], record["dst"])
    if record["src"] is None:
        members = [r for r in record["ranks"] if r != me]
    else:
        members = [record["dst"] if record["src"] == me else record["src"]]
    return [m for m in members if m not in dumps or dumps[m]["counters"].get(key, 0) < record["seq"]]


def blocked_calls(dumps: dict[int, dict]) -> list[Wait]:
    """Every call some rank is blocked in, once, with its waiters and its missing members."""
    waits: dict[tuple, Wait] = {}
    for rank in sorted(dumps):
        record = dumps[rank].get("blocked")
        if record is None:
            continue
        key = (channel(record["group"], record["ranks"], record["src"], record["dst"]), record["seq"])
        wait = waits.setdefault(key, Wait(record["op"], record["group"], list(record["ranks"]), record["seq"],
                                          record["src"], record["dst"]))
        wait.waiters.append(rank)
        wait.missing = sorted(set(wait.missing) | set(_members_missing(record, rank, dumps)) - set(wait.waiters))
    return list(waits.values())


def _causes(rank: int, edges: dict[int, list[int]], blocked: set[int], seen: set[int]) -> set[int]:
    """The ranks not blocked in any call that `rank`'s waits lead to (empty on a cycle)."""
    if rank not in blocked:
        return {rank}
    if rank in seen:
        return set()
    seen.add(rank)
    found: set[int] = set()
    for missing in edges.get(rank, []):
        found |= _causes(missing, edges, blocked, seen)
    return found


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def hang_verdict(dumps: dict[int, dict], world_size: int) -> Verdict:
    """The verdict on the dumps of a hung job (rank -> dump; a rank without one is left out)."""
    waits = blocked_calls(dumps)
    blocked = {rank for rank, d in dumps.items() if d.get("blocked") is not None}
    edges: dict[int, list[int]] = {}
    for wait in waits:
        for waiter in wait.waiters:
            edges.setdefault(waiter, []).extend(wait.missing)
    culprits = sorted(set().union(*[_causes(r, edges, blocked, set()) for r in sorted(blocked)]))
    direct = [w for w in waits if set(w.missing) - blocked]
    chained = [w for w in waits if w.missing and not set(w.missing) - blocked]
    parts = [f"{_ranks(set(w.missing) - blocked)} never posted {w.named(missing_side=True)}; {_waiters(w)} wait in it"
             for w in sorted(direct, key=lambda w: (w.group, w.seq))]
    for wait in sorted(chained, key=lambda w: (w.group, w.seq)):
        behind = sorted(set().union(*[_causes(m, edges, blocked, set()) for m in wait.missing]))
        reason = f"itself waiting on {_ranks(behind)}" if behind else "in a cycle of waits (a deadlock)"
        parts.append(f"{_waiters(wait)} wait in {wait.named()} for {_ranks(wait.missing)}, {reason}")
    for wait in (w for w in waits if not w.missing):
        parts.append(f"{_waiters(wait)} wait in {wait.named()}, which every member posted (a stall in the backend)")
    silent = sorted(set(range(world_size)) - set(dumps))
    if silent:
        parts.append(f"no dump from {_ranks(silent)} (exited, or stuck where its watcher cannot run)")
    if not waits:
        parts.insert(0, "no rank is blocked in a call")
    return Verdict("; ".join(parts), culprits, waits)


def _waiters(wait: Wait) -> str:
    return f"ranks {wait.waiters}"
