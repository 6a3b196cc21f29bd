"""This machine's loopback, measured as the runs will see it: `world` gloo ranks on its cores.

With net=none every rank talks to the others over loopback, and the rate a collective reaches is
set by the cores that copy and reduce the bytes, shared with everything else running, not by a
wire: two ranks on two cores move several times more per rank than four. So the planner measures
it with the world size it plans for, the way the runs will use it:

    rate      the bytes one rank sends in an all-reduce of 8 MiB (ring convention, 2(N-1)/N · S)
              over the time it takes, best of 5 (the collective's own figure, as comm.py counts it)
    latency   the time of a 4-byte all-reduce over its 2(N-1) ring steps, best of 20
    codec     the lossy collectives' elementwise rate (parallel/planner/codec.py's probe), timed on every
              rank at once after a barrier, as a run's ranks quantize after the same backward: the
              cores' share is in the time; the mean over the ranks

`python -m torch.distributed.run --standalone --nproc-per-node N -m parallel.planner.loopback`
prints the three as JSON on rank 0; `measure(world)` runs that and reads them.
"""

from __future__ import annotations

import json
import os
import sys
import time

from parallel.dist.binding import threads_per_rank
from parallel.dist.comm import TOOLING_PREFIX, CommLog, Communicator
from parallel.dist.gloo_loop import apply_gloo_loop_policy
from parallel.dist.groups import exit_process
from parallel.replay.probe import run_probe

PAYLOAD_BYTES = 8 * 2**20  # the docstring's 8 MiB all-reduce (its own: the run probe's is parallel/replay/probe.py's)
TAG = TOOLING_PREFIX + "planner_loopback"


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, in wall seconds (the planner's method)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _codec_rate(world: Communicator, n: int) -> float:
    """The codec probe on every rank at once (after a barrier), its rate averaged over the ranks."""
    import torch

    from parallel.planner.codec import probed_bytes_per_s

    world.barrier(tag=f"{TAG}/codec")
    rate = torch.tensor([probed_bytes_per_s(threads_per_rank(n))], dtype=torch.float64)
    world.all_reduce(rate, tag=f"{TAG}/codec")
    return float(rate) / n


def main() -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo")
    apply_gloo_loop_policy(sys.argv[1] if len(sys.argv) > 1 else "batch")  # as a run sets it (run_probe)
    world = Communicator("world", dist.group.WORLD, CommLog())  # its calls go through comm.py, as every call does
    n = world.size
    torch.set_num_threads(threads_per_rank(n))
    big, small = torch.ones(PAYLOAD_BYTES // 4), torch.ones(1)
    world.all_reduce(big, tag=f"{TAG}/warm")
    seconds = best_time(lambda: world.all_reduce(big, tag=f"{TAG}/payload"), 5)
    tiny = best_time(lambda: world.all_reduce(small, tag=f"{TAG}/small"), 20)
    codec = _codec_rate(world, n)
    if world.rank == 0:
        sent = 2 * (n - 1) / n * PAYLOAD_BYTES
        print(json.dumps({"bytes_per_s": sent / seconds, "latency_s": tiny / max(1, 2 * (n - 1)),
                          "codec_bytes_per_s": codec, "ranks": n}))
    dist.destroy_process_group()
    exit_process(0)  # past gloo's finalisation abort (parallel/dist/groups.py): the JSON line is out


def measure(world: int, timeout_s: float = 120) -> dict:
    """{"bytes_per_s": per rank, "latency_s": per ring step, "codec_bytes_per_s": per rank} with `world`
    ranks (2 for one rank: a one-rank job has no links, and its rate is never used; its codec rate is
    `codec.probed_bytes_per_s` in the planner's own process)."""
    return run_probe("parallel.planner.loopback", max(2, world), timeout_s)


if __name__ == "__main__":
    main()
