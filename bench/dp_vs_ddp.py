"""Bucketed `dp` against PyTorch DDP, and the cost of the communication log, in one run.

    torchrun --standalone --nproc-per-node 2 bench/dp_vs_ddp.py                 # small model
    torchrun --standalone --nproc-per-node 2 bench/dp_vs_ddp.py model=tiny rounds=3

All variants live in the same processes and take turns (round-robin with a rotating start,
`steps` steps each per round), so machine noise and drift fall on all of them alike. Each variant's step time is the
median over its timed steps of the slowest rank; the printed ratios compare medians measured in
this one run. Variants:

    dp           hand-written bucketed data parallel, communication log on (the default)
    dp_log_off   the same with the log's recording switched off: the log's own overhead
    torch_ddp    torch.nn.parallel.DistributedDataParallel, same buckets, same model and data

Options are Hydra-style key=value overrides of the training config (model=..., train.global_batch=...,
parallel.bucket_mb=...), plus rounds=N and steps=N for the benchmark itself.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial

from harness import plan_for, rotation, run_distributed, split_args, timed_step

from parallel.baselines.ddp import TorchDDP
from parallel.core.data import GlobalBatches, local_microbatches
from parallel.core.model import GPT
from parallel.dist.comm import CommLog, Communicator, summarize_traffic
from parallel.dist.groups import LaunchEnv
from parallel.dp.strategy import DataParallel
from parallel.strategy import make_optimizer


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = split_args(sys.argv[1:], {"rounds": "5", "steps": "4"})
    plan = plan_for(env, ["model=small", "parallel=dp"], overrides)
    run_distributed(env, plan,
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
        "dp": DataParallel(m1, optimizer_for(m1), dp_comm, "bucketed", plan.bucket_mb),
        "dp_log_off": DataParallel(m2, optimizer_for(m2), silent, "bucketed", plan.bucket_mb),
        "torch_ddp": TorchDDP(m3, optimizer_for, dp_comm, plan.bucket_mb),
    }
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    step = 0
    last_traffic = {}
    names = list(variants)
    for r in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for name in rotation(names, r):
            strategy = variants[name]
            for _ in range(steps):
                glob = batches(step)
                mbs = [mb.to(ctx.device)
                       for mb in local_microbatches(glob, ctx.coords["dp"], plan.dims.dp, plan.microbatches)]
                seconds, _, last_traffic[name] = timed_step(ctx, partial(strategy.train_step, mbs, glob.n_tokens))
                if r > 0 and ctx.is_rank0:
                    times[name].append(seconds)
                step += 1
    for strategy in variants.values():
        strategy.close()
    calls_per_step = summarize_traffic(last_traffic["dp"])["total"].calls
    if ctx.is_rank0:
        report(plan, times, rounds, steps, calls_per_step)


def seconds_per_record(n: int = 20_000) -> float:
    """The log's own cost per call: what `Communicator` adds to each collective (no I/O, no sync)."""
    log = CommLog()
    log.begin_step()
    start = time.perf_counter()
    for i in range(n):
        log.record("all_reduce", "dp", f"grads/bucket{i % 4}", 1 << 20, 4, time.perf_counter() - start)
    return (time.perf_counter() - start) / n


def report(plan, times: dict[str, list[float]], rounds: int, steps: int, calls_per_step: int) -> None:
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = plan.tokens_per_step
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"world {plan.dims.world_size} | global batch {plan.global_batch} | bucket {plan.bucket_mb} MiB | "
          f"{rounds} rounds x {steps} steps per variant (medians of the slowest rank)")
    print(f"{'variant':<12} {'step ms':>9} {'tokens/s':>10}")
    for name, seconds in med.items():
        print(f"{name:<12} {seconds * 1e3:9.1f} {tokens / seconds:10.0f}")
    print(f"\ndp / torch_ddp tokens/s ratio: {med['torch_ddp'] / med['dp']:.3f}  (>1: hand-written dp is faster)")
    print(f"communication log, on vs off: {100 * (med['dp'] / med['dp_log_off'] - 1):+.1f}% step time "
          "(an A/B of medians: within the noise of this machine)")
    per_call = seconds_per_record()
    print(f"communication log, direct cost: {per_call * 1e6:.2f} us per call x {calls_per_step} calls per step "
          f"= {100 * per_call * calls_per_step / med['dp']:.4f}% of dp's step")


if __name__ == "__main__":
    main()
