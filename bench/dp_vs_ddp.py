"""Bucketed `dp` against PyTorch DDP, and the cost of the communication log, in one run.

    torchrun --standalone --nproc-per-node 2 -m bench.dp_vs_ddp                 # small model
    torchrun --standalone --nproc-per-node 2 -m bench.dp_vs_ddp model=tiny rounds=3

The variants take turns in the same processes (bench/harness.py: `alternate`):

    dp           hand-written bucketed data parallel, communication log on (the default)
    dp_log_off   the same with the log's recording switched off: the log's own overhead
    torch_ddp    torch.nn.parallel.DistributedDataParallel, same buckets, same model and data

Options are Hydra-style key=value overrides of the training config (model=..., train.global_batch=...,
parallel.bucket_mb=...), plus rounds=N and steps=N for the benchmark itself.
"""

from __future__ import annotations

import sys
import time

from bench import harness
from parallel.baselines.ddp import TorchDDP
from parallel.core.model import GPT
from parallel.dist.comm import CommLog, Communicator, summarize_traffic
from parallel.dist.groups import LaunchEnv
from parallel.dp.strategy import DataParallel
from parallel.strategy import make_optimizer
from parallel.sync.options import SyncOptions


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = harness.split_args(sys.argv[1:], {"rounds": "5", "steps": "4"})
    plan = harness.plan_for(env, ["model=small", "parallel=dp"], overrides)
    harness.run_distributed(env, plan,
                    lambda plan, ctx, corpus: run(plan, ctx, corpus, int(opts["rounds"]), int(opts["steps"])))


def run(plan, ctx, corpus, rounds: int, steps: int) -> None:
    dp_comm = ctx.comm("dp")
    silent = Communicator("dp", dp_comm.group, CommLog(enabled=False))

    def fresh_model():
        return GPT(plan.model, seed=plan.seed).to(ctx.device)

    def optimizer_for(m):
        return make_optimizer(m, plan.lr, plan.weight_decay)

    m1, m2, m3 = fresh_model(), fresh_model(), fresh_model()
    variants = {
        "dp": DataParallel(m1, optimizer_for(m1), dp_comm, "bucketed", plan.layout.of(SyncOptions).bucket_mb),
        "dp_log_off": DataParallel(m2, optimizer_for(m2), silent, "bucketed", plan.layout.of(SyncOptions).bucket_mb),
        "torch_ddp": TorchDDP(m3, optimizer_for, dp_comm, plan.layout.of(SyncOptions).bucket_mb),
    }
    timings, traffic = harness.alternate(ctx, variants, harness.Steps(plan, ctx, corpus), rounds, steps)
    for strategy in variants.values():
        strategy.close()
    if ctx.is_rank0:
        report(plan, timings, rounds, steps, summarize_traffic(traffic["dp"])["total"].calls)


def seconds_per_record(n: int = 20_000) -> float:
    """The log's own cost per call: what `Communicator` adds to each collective (no I/O, no sync)."""
    log = CommLog()
    log.begin_step()
    start = time.perf_counter()
    for i in range(n):
        log.record("all_reduce", "dp", f"grads/bucket{i % 4}", 1 << 20, 4, time.perf_counter() - start)
    return (time.perf_counter() - start) / n


def report(plan, timings, rounds: int, steps: int, calls_per_step: int) -> None:
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"world {plan.dims.world_size} | global batch {plan.global_batch} | "
          f"bucket {plan.layout.of(SyncOptions).bucket_mb} MiB\n"
          f"{harness.timing_note(rounds, steps)}")
    harness.print_timings(timings, plan.tokens_per_step)
    print()
    harness.print_ratio(timings, "dp", "torch_ddp")
    log_on, log_off = timings.median("dp"), timings.median("dp_log_off")
    print(f"communication log, on vs off: {100 * (log_on / log_off - 1):+.1f}% step time "
          "(an A/B of medians: within the noise of the machine if small)")
    per_call = seconds_per_record()
    print(f"communication log, direct cost: {per_call * 1e6:.2f} us per call x {calls_per_step} calls per step "
          f"= {100 * per_call * calls_per_step / log_on:.4f}% of dp's step")


if __name__ == "__main__":
    main()
