"""How many seconds a step of `small` spends in the sharded strategies' copies around their collectives.

On 4 gloo ranks (shard groups {0,1}, {2,3}; one microbatch of 4 sequences per rank, one torch
thread each), zero3, hsdp, hsdp_zero2 and torch_hsdp take a warm-up step and then `steps` timed
ones under a dispatch mode that clocks every operation the planner's copies table
(parallel/planner/shard_copies.py) names: zeros, copy_, add_, zero_ and FSDP2's all_gather_copy_in,
split_with_sizes_copy and chunk_cat, over tensors of 4096 elements or more (the model's own ops of
those names are smaller). The transport (the Communicator's calls) and the optimizer's step are not
clocked. Prints, per strategy, each rank's median seconds of copies and of the whole step (wall clock;
the dispatch mode itself slows the step). Run: python -m lab.shard_copies_seconds [steps=5]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

COPIES = ("zeros", "copy_", "add_", "zero_", "all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")
FLOOR = 4096


def _clock():
    """A dispatch mode with the seconds spent in COPIES operations over FLOOR elements or more."""
    from dispatch_pause import PausableMode

    class CopyClock(PausableMode):
        seconds = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - start
            if not self.inside and func.overloadpacket.__name__ in COPIES and any(
                    isinstance(t, torch.Tensor) and t.numel() >= FLOOR for t in tree_flatten((args, kwargs, out))[0]):
                self.seconds += seconds
            return out

    return CopyClock()


def _small():
    from parallel.core.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, seq_len=128, n_layers=8, d_model=256, n_heads=8), seed=0)


def _timed(strategy, comms, rank: int, steps: int) -> list[tuple[float, float]]:
    from parallel.core.data import Batch

    x = torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(rank))
    batch = [Batch(x[:, :-1], x[:, 1:])]
    strategy.guard_finite = lambda _loss: None
    strategy.train_step(batch, 512)
    clock = _clock()
    for comm in comms:
        comm._run = clock.pause(comm._run)
    strategy.optimizer.step = clock.pause(strategy.optimizer.step)
    out = []
    for _ in range(steps):
        clock.seconds, start = 0.0, time.perf_counter()
        with clock:
            strategy.train_step(batch, 512)
        out.append((clock.seconds, time.perf_counter() - start))
    return out


def _ranks(rank: int, world: int, out_dir, steps: int):
    from spawn import write_result

    from parallel.baselines.fsdp2_hsdp import TorchHSDP, hsdp_mesh
    from parallel.dist.comm import CommLog, Communicator
    from parallel.zero.hsdp import HSDP, HSDPZero2
    from parallel.zero.zero3 import Zero3

    shard_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    replicate_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    dp = Communicator("dp", dist.group.WORLD, CommLog())
    shard = Communicator("dp_shard", shard_groups[rank // 2], CommLog())
    replicate = Communicator("dp_replicate", replicate_groups[rank % 2], CommLog())
    comms = [dp, shard, replicate]
    found = {"zero3": _timed(Zero3(_small(), dp, 1e-3, 0.1), [dp], rank, steps),
             "hsdp": _timed(HSDP(_small(), dp, shard, replicate, 1e-3, 0.1), comms, rank, steps),
             "hsdp_zero2": _timed(HSDPZero2(_small(), dp, shard, replicate, 1e-3, 0.1), comms, rank, steps)}
    mesh = hsdp_mesh([0, 1, 2, 3], shard, replicate, "cpu")
    found["torch_hsdp"] = _timed(TorchHSDP(_small(), mesh, dp, shard, replicate, 1e-3, 0.1), comms, rank, steps)
    write_result(out_dir, rank, found)


def main(argv: list[str]) -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from spawn import run_ranks

    steps = int(next((a.split("=")[1] for a in argv if a.startswith("steps=")), 5))
    ranks = run_ranks(4, _ranks, steps)
    for name in ranks[0]:
        copies = [round(statistics.median(c for c, _ in r[name]), 3) for r in ranks]
        step = [round(statistics.median(w for _, w in r[name]), 2) for r in ranks]
        print(f"{name:11} copies s per step (median of {steps}, by rank) {copies}   step s {step}")


if __name__ == "__main__":
    main(sys.argv[1:])
