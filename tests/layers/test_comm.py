"""The communication log on a real 2- and 3-rank gloo group: what each op records, and the data it moves."""

import os
import tempfile
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.dist.comm import CommLog, Communicator, summarize_traffic
from parallel.dist.groups import exit_process


def _worker(rank, world, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        log = CommLog()
        comm = Communicator("dp", dist.group.WORLD, log)
        log.begin_step()
        x = torch.full((6,), float(rank + 1))
        comm.all_reduce(x, tag="grads")
        full = torch.empty(6 * world)
        comm.all_gather_into(full, torch.full((6,), float(rank)), tag="params")
        shard = torch.empty(2)
        comm.reduce_scatter(shard, torch.arange(2.0 * world), tag="grads")
        h = comm.all_reduce(torch.ones(3), tag="grads", async_op=True)
        assert comm.pending == 1
        h.wait()
        assert comm.pending == 0
        b = torch.full((4,), float(rank))
        comm.broadcast(b, 0, tag="init")
        if rank == 0:
            comm.send(torch.ones(5), 1, tag="act")
        elif rank == 1:
            r = torch.empty(5)
            comm.recv(r, 0, tag="act")
            assert torch.equal(r, torch.ones(5))
        comm.all_reduce(torch.ones(1), tag="tooling/loss")
        traffic = log.end_step()
        results[rank] = {
            "x": x.tolist(), "full": full.tolist(), "shard": shard.tolist(), "b": b.tolist(),
            "traffic": {k: (v.calls, v.payload_bytes, v.sent_bytes) for k, v in traffic.items()},
            "strategy_sent": summarize_traffic(traffic)["total"].sent_bytes,
            "tooling_sent": summarize_traffic(traffic, include_tooling=True)["total"].sent_bytes,
        }
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort interpreter finalisation (parallel/dist/groups.py: exit_process).
    exit_process(0)


@pytest.mark.parametrize("world", [2, 3])
def test_each_op_moves_the_data_and_records_ring_bytes(world):
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), results), nprocs=world, join=True)
    n = world
    total = sum(range(1, n + 1))
    for rank in range(n):
        r = results[rank]
        assert r["x"] == [float(total)] * 6
        assert r["full"] == [float(i) for i in range(n) for _ in range(6)]
        assert r["shard"] == [float(n * (2 * rank)), float(n * (2 * rank + 1))]
        assert r["b"] == [0.0] * 4
        t = r["traffic"]
        assert t[("all_reduce", "dp", "grads")] == (2, 6 * 4 + 3 * 4, Fraction(2 * (n - 1), n) * 36)
        assert t[("all_gather", "dp", "params")] == (1, 6 * n * 4, Fraction(n - 1, n) * 6 * n * 4)
        assert t[("reduce_scatter", "dp", "grads")] == (1, 2 * n * 4, Fraction(n - 1, n) * 2 * n * 4)
        assert t[("broadcast", "dp", "init")] == (1, 16, Fraction(16))
        assert t[("all_reduce", "dp", "tooling/loss")] == (1, 4, Fraction(2 * (n - 1), n) * 4)
        sends = Fraction(20) if rank == 0 else Fraction(0)
        assert r["strategy_sent"] == (Fraction(2 * (n - 1), n) * 36 + Fraction(n - 1, n) * (24 * n + 8 * n)
                                      + 16 + sends)
        assert r["tooling_sent"] == Fraction(2 * (n - 1), n) * 4
    assert results[1]["traffic"][("recv", "dp", "act")] == (1, 20, Fraction(0))


def test_disabled_log_records_nothing():
    log = CommLog(enabled=False)
    log.begin_step()
    log.record("all_reduce", "dp", "grads", 100, 2)
    assert log.end_step() == {}


def test_calls_outside_steps_are_kept_apart():
    log = CommLog()
    log.record("broadcast_object", "world", "tooling/run_dir", 50, 2)
    log.begin_step()
    log.record("all_reduce", "dp", "grads", 100, 2)
    step = log.end_step()
    assert list(step) == [("all_reduce", "dp", "grads")]
    assert list(log.outside) == [("broadcast_object", "world", "tooling/run_dir")]
