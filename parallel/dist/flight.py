"""The flight recorder: each rank's last communication calls, kept in a ring, dumped when a call hangs.

Every call a Communicator makes (parallel/dist/comm.py, the only writer) leaves one record here:

  op         all_reduce, all_gather, send, recv, barrier, ...
  group      the group's name ("tp", "dp", "world") and its global `ranks`
  seq        the call's number on its channel, counted from 1 on every rank alike: a collective's
             channel is its group (every member makes the group's calls in the same order, so
             all_reduce #37 of tp [2, 3] is the same call on both ranks); a send's or receive's is
             the pair's direction (`src` -> `dst`, global ranks), so the k-th send from 2 to 3 on a
             group meets the k-th receive from 2 on 3
  tag, bytes what it carried
  state      posted (the call is made, or an async call is in flight), completed, or failed
  times      when it was posted and when it ended (unix time: one axis for the ranks of a machine)

A rank also keeps, out of the ring, the last number it posted on each channel (`counters`): a peer
that never reached call #37 is told apart from one whose records the ring has dropped. And it knows
the call its training thread is blocked in now (`blocked`), or the one that failed: a rank that
waits in no call while its peers wait for it is where a hang starts (parallel/reliability/hangs.py).

The ring holds `CAPACITY` records (NCCL's flight recorder keeps a configurable number too); a record
is a handful of slots and two clock reads, so it is always on. `DumpWatcher` is the thread that
writes the ring to the run directory when asked to, even while the training thread is stuck.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path

CAPACITY = 64
POLL_S = 0.1  # how often the watcher looks for a dump request: a stat, a few microseconds


def channel(group: str, ranks, src: int | None = None, dst: int | None = None) -> str:
    """The key a call is numbered under: its group, and for a send or receive the direction."""
    base = f"{group} {list(ranks)}"
    return base if src is None else f"{base} {src}->{dst}"


class FlightRecord:
    """One call. Slots, not a dict: recording it costs a few hundred nanoseconds."""

    __slots__ = ("op", "group", "ranks", "seq", "tag", "bytes", "src", "dst", "state", "posted_at", "ended_at")

    def __init__(self, op, group, ranks, seq, tag, nbytes, src, dst):
        self.op, self.group, self.ranks, self.seq, self.tag, self.bytes = op, group, ranks, seq, tag, nbytes
        self.src, self.dst = src, dst
        self.state, self.posted_at, self.ended_at = "posted", time.time(), None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class FlightRecorder:
    """One rank's ring of its last CAPACITY calls, shared by all its communicators."""

    def __init__(self, capacity: int = CAPACITY):
        self.records: collections.deque[FlightRecord] = collections.deque(maxlen=capacity)
        self.counters: dict[str, int] = {}
        self.blocked: FlightRecord | None = None
        self.directory: Path | None = None  # where dumps go, once the run directory exists

    def post(self, op: str, group: str, ranks, tag: str, nbytes: int, src: int | None = None,
             dst: int | None = None, key: str | None = None) -> FlightRecord:
        """A call made; `src`, `dst` (global ranks) for a send or receive; `key`: its `channel`, if
        the caller keeps it (formatting it anew is most of a record's cost)."""
        key = key or channel(group, ranks, src, dst)
        seq = self.counters.get(key, 0) + 1
        self.counters[key] = seq
        record = FlightRecord(op, group, ranks, seq, tag, nbytes, src, dst)
        self.records.append(record)
        return record

    def block(self, record: FlightRecord) -> None:
        """The training thread waits in `record` from now until it completes or fails."""
        self.blocked = record

    def complete(self, record: FlightRecord) -> None:
        record.state, record.ended_at = "completed", time.time()
        if self.blocked is record:
            self.blocked = None

    def fail(self, record: FlightRecord) -> None:
        """The call raised (a timeout, a dead peer): it stays the call this rank was blocked in."""
        record.state, record.ended_at = "failed", time.time()
        self.blocked = record

    def snapshot(self, rank: int, reason: str) -> dict:
        """What a dump holds. Read from another thread while the training thread may append: copying
        a deque or a dict is one step under the GIL."""
        blocked = self.blocked
        return {"rank": rank, "reason": reason, "time": time.time(), "capacity": self.records.maxlen,
                "blocked": blocked.as_dict() if blocked is not None else None,
                "counters": dict(self.counters), "records": [r.as_dict() for r in list(self.records)]}

    def dump(self, directory: Path, rank: int, reason: str) -> Path:
        """Write the ring to directory/rank_NNNNN.json, whole or not at all (a rename)."""
        path = dump_path(directory, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.snapshot(rank, reason), indent=1))
        tmp.replace(path)
        return path


def dump_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank:05d}.json"


def request_path(directory: Path) -> Path:
    return Path(directory) / "dump_request"


def request_dumps(directory: Path, rank: int) -> None:
    """Ask every rank's watcher for its ring (the first rank to time out does)."""
    path = request_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(f"rank {rank} at unix time {time.time():.3f}\n")


class DumpWatcher(threading.Thread):
    """A daemon thread that waits for a dump request in the run directory, writes this rank's ring,
    then calls `after_dump` (rank 0's verdict): it runs while the training thread is stuck in a call
    or in a hang of its own. A file, not the torchrun store: a blocking wait on the store would hold
    the store's one client connection, which the process groups use too. A request older than the
    watcher is a previous attempt's, and ignored."""

    def __init__(self, recorder: FlightRecorder, directory: Path, rank: int, after_dump=None):
        super().__init__(name="flight-recorder", daemon=True)
        self.recorder, self.directory, self.rank, self.after_dump = recorder, Path(directory), rank, after_dump
        self.started_at = time.time()

    def run(self) -> None:
        request = request_path(self.directory)
        while True:
            time.sleep(POLL_S)
            try:
                if request.stat().st_mtime < self.started_at - 1.0:
                    continue
            except FileNotFoundError:
                continue
            self.recorder.dump(self.directory, self.rank, "request")
            if self.after_dump is not None:
                self.after_dump()
            return
