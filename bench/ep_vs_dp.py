"""Expert parallelism against data parallelism on a mixture of experts, in one run.

    torchrun --standalone --nproc-per-node 4 bench/ep_vs_dp.py                       # small_moe, ep = 4
    torchrun --standalone --nproc-per-node 4 bench/ep_vs_dp.py parallel.ep=2 rounds=3
    torchrun --standalone --nproc-per-node 2 bench/ep_vs_dp.py model=tiny_moe

Both variants live in the same processes and take turns (round-robin with a rotating start, `steps`
steps each per round), so machine noise and drift fall on both alike. Each variant's step time is
the median over its timed steps of the slowest rank. Variants:

    dp   every rank holds every expert; all gradients all-reduced over dp (bucketed)
    ep   each rank holds E/ep experts of every MoE block; tokens carried to them by all-to-all;
         dense gradients over dp, the experts' over edp

Both start from the same weights and see the same batches in turn; their routing drifts apart as
they train, and with it the work each step does (dropped assignments cost nothing): the bytes
printed are each variant's own last step. Options are Hydra-style overrides of the training config
(model=..., parallel.ep=..., train.global_batch=...), plus rounds=N and steps=N.
"""

from __future__ import annotations

import statistics
import sys
from fractions import Fraction

from harness import plan_for, rotation, run_distributed, split_args, timed_step

from parallel.core.data import GlobalBatches, local_microbatches
from parallel.core.model import GPT
from parallel.dist.comm import summarize_traffic
from parallel.dist.groups import LaunchEnv
from parallel.dp.strategy import DataParallel
from parallel.moe.strategy import ExpertParallel
from parallel.moe.theory import ep_all_to_all_uniform_bytes
from parallel.strategy import make_optimizer


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = split_args(sys.argv[1:], {"rounds": "5", "steps": "3"})
    plan = plan_for(env, ["model=small_moe", "parallel=ep"], overrides)
    rounds, steps = int(opts["rounds"]), int(opts["steps"])
    run_distributed(env, plan, lambda plan, ctx, corpus: run(plan, ctx, corpus, rounds, steps))


def run(plan, ctx, corpus, rounds: int, steps: int) -> None:
    dense, sharded = GPT(plan.model, seed=plan.seed).to(ctx.device), GPT(plan.model, seed=plan.seed).to(ctx.device)
    variants = {
        "dp": DataParallel(dense, make_optimizer(dense, plan.lr, plan.weight_decay), ctx.comm("dp"), "bucketed",
                           plan.bucket_mb),
        "ep": ExpertParallel(sharded, ctx.comm("dp"), ctx.comm("ep"), ctx.comm("edp"), "bucketed", plan.bucket_mb,
                             plan.lr, plan.weight_decay),
    }
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    last_traffic = {}
    step = 0
    for r in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for name in rotation(list(variants), r):
            strategy = variants[name]
            for _ in range(steps):
                glob = batches(step)
                mbs = [mb.to(ctx.device) for mb in local_microbatches(glob, ctx.coords["dp"], plan.dims.dp,
                                                                      plan.microbatches)]
                seconds, _, last_traffic[name] = timed_step(
                    ctx, lambda s=strategy, m=mbs, g=glob: s.train_step(m, g.n_tokens))
                if r > 0 and ctx.is_rank0:
                    times[name].append(seconds)
                step += 1
    for strategy in variants.values():
        strategy.close()
    sent = {name: summarize_traffic(t) for name, t in last_traffic.items()}
    # Every rank's bytes of its last step, to rank 0.
    mine = {name: (s["total"].sent_bytes, s["by_group"]) for name, s in sent.items()}
    per_rank = ctx.comm("world").gather_object(mine, 0, tag="tooling/bench")
    if ctx.is_rank0:
        report(plan, times, rounds, steps, per_rank)


def report(plan, times: dict[str, list[float]], rounds: int, steps: int, per_rank: list[dict]) -> None:
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = plan.tokens_per_step
    uniform = ep_all_to_all_uniform_bytes(plan.model, plan.layout) * plan.dims.world_size
    print(f"\nmodel {plan.model.moe_experts} experts top-{plan.model.moe_top_k}, d_model={plan.model.d_model} "
          f"layers={plan.model.n_layers} seq={plan.model.seq_len} | world {plan.dims.world_size}, ep {plan.dims.ep} | "
          f"global batch {plan.global_batch} | {rounds} rounds x {steps} steps per variant "
          "(medians of the slowest rank)")
    print(f"{'variant':<8} {'step ms':>9} {'tokens/s':>10} {'MB/step':>9} {'all-to-all MB':>14}")
    for name, seconds in med.items():
        total = sum((r[name][0] for r in per_rank), Fraction(0))
        a2a = sum((r[name][1]["ep"].sent_bytes for r in per_rank if "ep" in r[name][1]), Fraction(0))
        print(f"{name:<8} {seconds * 1e3:9.1f} {tokens / seconds:10.0f} {float(total) / 1e6:9.3f} "
              f"{float(a2a) / 1e6:14.3f}")
    print(f"\nep / dp tokens/s ratio: {med['dp'] / med['ep']:.3f}  (>1: expert parallelism is faster); "
          f"all-to-all under uniform routing: {float(uniform) / 1e6:.3f} MB per step")


if __name__ == "__main__":
    main()
