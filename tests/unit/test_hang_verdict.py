"""The hang verdict on synthetic flight recorders: every rank's calls are posted through a real
FlightRecorder, as a Communicator posts them, and the verdict reads their snapshots."""

import json
import os
import time

from parallel.dist.comm import CommLog
from parallel.dist.flight import CAPACITY, DumpWatcher, FlightRecorder, dump_path, request_dumps
from parallel.dist.groups import LaunchEnv
from parallel.reliability.hang_verdict import hang_verdict
from parallel.reliability.hangs import report_hang, write_verdict

TP = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
DP = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}


def _calls(recorder, op, group, ranks, n):
    """`n` completed calls on the group."""
    for _ in range(n):
        recorder.complete(recorder.post(op, group, ranks, "t", 4))


def _block(recorder, op, group, ranks, src=None, dst=None):
    record = recorder.post(op, group, ranks, "t", 4, src, dst)
    recorder.block(record)
    return record


def _dumps(recorders):
    return {rank: rec.snapshot(rank, "request") for rank, rec in recorders.items()}


def test_the_rank_that_never_posted_is_named_by_group_and_number():
    ranks = {2: FlightRecorder(), 3: FlightRecorder()}
    for rec in ranks.values():
        _calls(rec, "all_reduce", "tp", [2, 3], 36)
    _block(ranks[3], "all_reduce", "tp", [2, 3])
    idle = {r: FlightRecorder().snapshot(r, "request") for r in (0, 1)}  # the other tp pair, done
    verdict = hang_verdict(_dumps(ranks) | idle, 4)
    assert verdict.line == "rank 2 never posted all_reduce #37 of group tp (ranks [2, 3]); ranks [3] wait in it"
    assert verdict.culprits == [2]


def test_a_chain_of_waits_through_two_groups_leads_to_the_rank_waiting_in_none():
    """dp 2 x tp 2, rank 2 hangs before its step: rank 3 waits for it in tp, rank 0 in dp, and rank 1
    in dp for rank 3, which is blocked itself: rank 1's wait names rank 2 behind rank 3."""
    recs = {r: FlightRecorder() for r in range(4)}
    for r, rec in recs.items():
        _calls(rec, "all_reduce", "tp", TP[r], 10)
        _calls(rec, "all_reduce", "dp", DP[r], 5)
    for r in (0, 1):  # the tp pair {0, 1} finishes its step and waits in dp
        _calls(recs[r], "all_reduce", "tp", TP[r], 2)
        _block(recs[r], "all_reduce", "dp", DP[r])
    _block(recs[3], "all_reduce", "tp", TP[3])
    verdict = hang_verdict(_dumps(recs), 4)
    assert verdict.culprits == [2]
    assert verdict.line == (
        "rank 2 never posted all_reduce #6 of group dp (ranks [0, 2]); ranks [0] wait in it; "
        "rank 2 never posted all_reduce #11 of group tp (ranks [2, 3]); ranks [3] wait in it; "
        "ranks [1] wait in all_reduce #6 of group dp (ranks [1, 3]) for rank 3, itself waiting on rank 2")


def test_several_missing_ranks_in_one_collective():
    world = [0, 1, 2, 3]
    recs = {r: FlightRecorder() for r in world}
    for rec in recs.values():
        _calls(rec, "all_reduce", "dp", world, 3)
    for r in (0, 3):
        _block(recs[r], "all_reduce", "dp", world)
    verdict = hang_verdict(_dumps(recs), 4)
    assert verdict.culprits == [1, 2]
    assert verdict.line == ("ranks [1, 2] never posted all_reduce #4 of group dp (ranks [0, 1, 2, 3]); "
                            "ranks [0, 3] wait in it")


def test_rank_0_hung():
    world = [0, 1, 2, 3]
    recs = {r: FlightRecorder() for r in world}
    for rec in recs.values():
        _calls(rec, "broadcast_object", "world", world, 2)
        _calls(rec, "all_reduce", "world", world, 7)
    for r in (1, 2, 3):
        _block(recs[r], "all_reduce", "world", world)
    verdict = hang_verdict(_dumps(recs), 4)
    assert verdict.culprits == [0]
    assert verdict.line.startswith("rank 0 never posted all_reduce #10 of group world (ranks [0, 1, 2, 3]); "
                                   "ranks [1, 2, 3] wait in it")


def test_a_blocked_receive_names_the_send_its_peer_never_posted():
    recs = {0: FlightRecorder(), 1: FlightRecorder()}
    for _ in range(3):
        recs[1].complete(recs[1].post("send", "pp", [0, 1], "a", 4, 1, 0))
        recs[0].complete(recs[0].post("recv", "pp", [0, 1], "a", 4, 1, 0))
    _block(recs[0], "recv", "pp", [0, 1], 1, 0)
    verdict = hang_verdict(_dumps(recs), 2)
    assert verdict.line == "rank 1 never posted send 1->0 #4 of group pp (ranks [0, 1]); ranks [0] wait in it"


def test_a_pipeline_chain_names_each_waiter_by_its_own_receive():
    """Rank 0 hangs: rank 1 waits for its activations, rank 2 for rank 1's."""
    recs = {r: FlightRecorder() for r in range(3)}
    _block(recs[1], "recv", "pp", [0, 1], 0, 1)
    _block(recs[2], "recv", "pp", [1, 2], 1, 2)
    verdict = hang_verdict(_dumps(recs), 3)
    assert verdict.culprits == [0]
    assert verdict.line == (
        "rank 0 never posted send 0->1 #1 of group pp (ranks [0, 1]); ranks [1] wait in it; "
        "ranks [2] wait in recv 1->2 #1 of group pp (ranks [1, 2]) for rank 1, itself waiting on rank 0")


def test_a_rank_without_a_dump_counts_as_missing():
    recs = {r: FlightRecorder() for r in (0, 1)}
    for rec in recs.values():
        _block(rec, "all_reduce", "world", [0, 1, 2])
    verdict = hang_verdict(_dumps(recs), 3)
    assert verdict.culprits == [2]
    assert verdict.line.endswith("; no dump from rank 2 (exited, or stuck where its watcher cannot run)")


def test_two_ranks_waiting_on_each_other_is_a_cycle_with_no_culprit():
    recs = {0: FlightRecorder(), 1: FlightRecorder()}
    _block(recs[0], "recv", "pp", [0, 1], 1, 0)
    _block(recs[1], "recv", "pp", [0, 1], 0, 1)
    verdict = hang_verdict(_dumps(recs), 2)
    assert verdict.culprits == []
    assert "in a cycle of waits (a deadlock)" in verdict.line


def test_the_ring_keeps_the_last_calls_and_the_counters_all():
    rec = FlightRecorder()
    _calls(rec, "all_reduce", "dp", [0, 1], CAPACITY + 36)
    snap = rec.snapshot(0, "request")
    assert len(snap["records"]) == CAPACITY
    assert snap["records"][-1]["seq"] == CAPACITY + 36 and snap["records"][0]["seq"] == 37
    assert snap["counters"] == {"dp [0, 1]": CAPACITY + 36}
    failed = _block(rec, "all_reduce", "dp", [0, 1])
    rec.fail(failed)
    assert rec.snapshot(0, "timeout")["blocked"]["state"] == "failed"


def test_watchers_dump_on_request_and_one_rank_writes_the_verdict(tmp_path):
    recs = {r: FlightRecorder() for r in (0, 1)}
    _block(recs[0], "all_reduce", "world", [0, 1])
    watchers = [DumpWatcher(rec, tmp_path, r) for r, rec in recs.items()]
    for watcher in watchers:
        watcher.start()
    request_dumps(tmp_path, 0)
    for watcher in watchers:
        watcher.join(timeout=10)
    assert all(dump_path(tmp_path, r).exists() for r in recs)
    line = write_verdict(tmp_path, 2, 0)
    assert line.endswith("rank 1 never posted all_reduce #1 of group world (ranks [0, 1]); ranks [0] wait in it")
    assert write_verdict(tmp_path, 2, 1) is None  # claimed already: one verdict per hang
    assert json.loads((tmp_path / "verdict.json").read_text())["culprits"] == [1]


def test_a_watcher_ignores_a_request_older_than_itself(tmp_path):
    request_dumps(tmp_path, 0)
    old = time.time() - 60
    os.utime(tmp_path / "dump_request", (old, old))
    watcher = DumpWatcher(FlightRecorder(), tmp_path, 0)
    watcher.start()
    watcher.join(timeout=0.5)
    assert watcher.is_alive() and not dump_path(tmp_path, 0).exists()


class _Rank:
    """What report_hang reads of a rank's DistContext: its rank, world size and communication log."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.env, self.log = rank, LaunchEnv(rank=rank, world_size=world_size), CommLog()


def test_a_rank_that_timed_out_writes_the_verdict_when_rank_0_cannot(tmp_path):
    """Rank 0 is gone (no watcher, no dump): rank 1, whose receive from it timed out, waits for rank
    0's verdict, then writes its own, naming rank 0 as the rank without a dump."""
    me = _Rank(1, 2)
    me.log.flight.directory = tmp_path
    me.log.flight.fail(_block(me.log.flight, "recv", "pp", [0, 1], 0, 1))
    report_hang(me, RuntimeError("Timed out waiting 8000ms for recv operation to complete"), wait_s=0.2)
    verdict = (tmp_path / "verdict.txt").read_text()
    assert verdict.startswith("hang verdict (rank 1, ")
    assert verdict.rstrip().endswith(
        "rank 0 never posted send 0->1 #1 of group pp (ranks [0, 1]); ranks [1] wait in it; "
        "no dump from rank 0 (exited, or stuck where its watcher cannot run)")
    assert json.loads(dump_path(tmp_path, 1).read_text())["reason"] == "timeout"


def test_a_failure_that_is_no_timeout_dumps_nothing(tmp_path):
    me = _Rank(1, 2)
    me.log.flight.directory = tmp_path
    report_hang(me, RuntimeError("Connection closed by peer [127.0.0.1]:5678"))
    assert list(tmp_path.iterdir()) == []
