"""This machine's loopback as a link model: probed inside a run, with one rank per core.

The replay needs the rate and the per-step latency one rank's transfers reach when it has a core
of its own, not the contended figures of N ranks on fewer cores. So two ranks of one node (global
rank 0 and the next rank on its node) measure them between themselves, after the timed steps,
while every other rank waits in a barrier (a gloo barrier blocks in a receive: it takes no core):

    rate      bytes one rank sends in an all-reduce of 8 MiB (2(n-1)/n S, n = 2) over its best time of 3
    latency   a 4-byte all-reduce's best time of 20, over its 2(n-1) = 2 ring steps

the method of parallel/planner/loopback.py, at two ranks. About 0.1 s. A figure given in the
config (`virtual.loopback_gbytes_per_s`, `virtual.loopback_latency_us`, which launch.compare
measures once per sweep) is used as given instead. Nothing here goes through the communication
log: it is not the strategy's traffic.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel.replay.links import LinkModel, loopback

PAYLOAD_BYTES = 8 * 2**20
# When no two ranks share a node (every rank on its own emulated node): this machine's figures as
# measured for the planner (conf/cluster/this_machine.yaml: 2 ranks, 1.3 GB/s, 80 us per 4-byte all-reduce).
FALLBACK = {"bytes_per_s": 1.3e9, "latency_s": 40e-6}


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, in wall seconds (the probe's and the planner's)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def probe_loopback(rank: int, world: int, node_of, given: dict | None = None) -> LinkModel:
    """Every rank calls this (a group is made); every rank gets the model (rank 0's figures)."""
    given = given or {}
    if given.get("loopback_gbytes_per_s") and given.get("loopback_latency_us") is not None:
        return loopback(float(given["loopback_gbytes_per_s"]) * 1e9, float(given["loopback_latency_us"]) * 1e-6,
                        "given (virtual.loopback_gbytes_per_s, virtual.loopback_latency_us)")
    partner = next((r for r in range(1, world) if node_of(r) == node_of(0)), None)
    if world < 2 or partner is None or not dist.is_initialized():
        return loopback(FALLBACK["bytes_per_s"], FALLBACK["latency_s"],
                        "this machine's planner figures (no two ranks on one node to probe with)")
    pair = dist.new_group([0, partner], backend="gloo")
    figures = torch.zeros(2, dtype=torch.float64)
    if rank in (0, partner):
        big, small = torch.ones(PAYLOAD_BYTES // 4), torch.ones(1)
        dist.all_reduce(big, group=pair)
        seconds = best_time(lambda: dist.all_reduce(big, group=pair), 3)
        tiny = best_time(lambda: dist.all_reduce(small, group=pair), 20)
        latency = tiny / 2
        figures[:] = torch.tensor([PAYLOAD_BYTES / max(seconds - 2 * latency, 1e-9), latency])
    dist.broadcast(figures, src=0)
    dist.destroy_process_group(pair)
    return loopback(float(figures[0]), float(figures[1]),
                    f"probed in this run: ranks 0 and {partner}, one per core, 8 MiB and 4-byte all-reduces")
