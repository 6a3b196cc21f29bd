"""The flight recorder as the Communicator fills it (parallel/dist/flight.py), on 3 real gloo ranks.

Every rank makes the same calls on the world and on a subgroup {1, 2}, blocking and async, a send
and receive and a batch of them, and one receive that times out: each call's number is the same on
every rank that makes it (collectives per group, sends and receives per direction), every call
that returned is completed, and the one that timed out is left failed as the call the rank is
blocked in.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from spawn import run_ranks, write_result

from parallel.dist.comm import CommFailure, CommLog, Communicator


def calls(rank: int, world: int, out_dir) -> None:
    log = CommLog()
    comm = Communicator("world", dist.group.WORLD, log)
    pair = dist.new_group([1, 2])
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    for _ in range(2):
        comm.all_reduce(torch.ones(2), tag="t")
    comm.all_reduce(torch.ones(2), tag="t", async_op=True).wait()
    if rank in (1, 2):
        Communicator("tp", pair, log).all_reduce(torch.ones(1), tag="t")
    if rank == 0:
        for _ in range(2):
            comm.send(torch.ones(1), 1, tag="a")
    elif rank == 1:
        for _ in range(2):
            comm.recv(torch.empty(1), 0, tag="a")
    if rank in (1, 2):
        peer = 3 - rank
        for handle in comm.batch_p2p([("recv", torch.empty(1), peer, "b"), ("send", torch.ones(1), peer, "b")]):
            handle.wait()
    comm.broadcast_object("x", 0, tag="tooling/t")
    failed = None
    if rank == 0:  # rank 1 never sends on this group: the receive times out after 1 s
        try:
            Communicator("short", short, log).recv(torch.empty(1), 1, tag="never")
        except CommFailure as e:
            failed = str(e)
    write_result(out_dir, rank, {"snapshot": log.flight.snapshot(rank, "test"), "failed": failed})


@pytest.fixture(scope="module")
def results():
    return run_ranks(3, calls)


def test_each_call_has_the_same_number_on_every_rank_that_makes_it(results):
    counters = [r["snapshot"]["counters"] for r in results]
    assert [c["world [0, 1, 2]"] for c in counters] == [4, 4, 4]  # 2 + 1 async all-reduces + the broadcast
    assert counters[1]["tp [1, 2]"] == counters[2]["tp [1, 2]"] == 1 and "tp [1, 2]" not in counters[0]
    assert counters[0]["world [0, 1, 2] 0->1"] == counters[1]["world [0, 1, 2] 0->1"] == 2
    for direction in ("1->2", "2->1"):
        assert counters[1][f"world [0, 1, 2] {direction}"] == counters[2][f"world [0, 1, 2] {direction}"] == 1
    world_ops = [[(r["op"], r["seq"]) for r in res["snapshot"]["records"] if r["group"] == "world" and r["src"] is None]
                 for res in results]
    assert world_ops[0] == world_ops[1] == world_ops[2] == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3),
                                                            ("broadcast_object", 4)]


def test_calls_that_returned_are_completed_and_the_timed_out_one_is_blocked_and_failed(results):
    for rank in (1, 2):
        snap = results[rank]["snapshot"]
        assert snap["blocked"] is None and {r["state"] for r in snap["records"]} == {"completed"}
    snap = results[0]["snapshot"]
    assert "Timed out" in results[0]["failed"]
    blocked = snap["blocked"]
    assert (blocked["op"], blocked["group"], blocked["src"], blocked["dst"], blocked["seq"], blocked["state"]) == \
        ("recv", "short", 1, 0, 1, "failed")
    assert [r["state"] for r in snap["records"]][:-1] == ["completed"] * (len(snap["records"]) - 1)
