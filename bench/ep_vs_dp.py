"""Expert parallelism against data parallelism on a mixture of experts, in one run.

    torchrun --standalone --nproc-per-node 4 -m bench.ep_vs_dp                       # small_moe, ep = 4
    torchrun --standalone --nproc-per-node 4 -m bench.ep_vs_dp parallel.ep=2 rounds=3
    torchrun --standalone --nproc-per-node 2 -m bench.ep_vs_dp model=tiny_moe

PyTorch has no expert parallelism to set beside ours, so the reference is data parallelism on the
same model. The variants take turns in the same processes (bench/harness.py: `alternate`):

    dp   every rank holds every expert; all gradients all-reduced over dp (bucketed)
    ep   each rank holds E/ep experts of every MoE block; tokens carried to them by all-to-all;
         dense gradients over dp, the experts' over edp

Both start from the same weights and see the same batches; their routing drifts apart as they
train, and with it the work each step does (dropped assignments cost nothing): the bytes printed
are each variant's own last step. Options are Hydra-style overrides of the training config
(model=..., parallel.ep=..., train.global_batch=...), plus rounds=N and steps=N.
"""

from __future__ import annotations

import sys
from fractions import Fraction

from bench import harness
from parallel.core.model import GPT
from parallel.dist.comm import summarize_traffic
from parallel.dist.groups import LaunchEnv
from parallel.dp.strategy import DataParallel
from parallel.moe.strategy import ExpertParallel
from parallel.moe.theory import ep_all_to_all_uniform_bytes
from parallel.strategy import make_optimizer
from parallel.sync.options import SyncOptions


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = harness.split_args(sys.argv[1:], {"rounds": "5", "steps": "3"})
    plan = harness.plan_for(env, ["model=small_moe", "parallel=ep"], overrides)
    rounds, steps = int(opts["rounds"]), int(opts["steps"])
    harness.run_distributed(env, plan, lambda plan, ctx, corpus: run(plan, ctx, corpus, rounds, steps))


def run(plan, ctx, corpus, rounds: int, steps: int) -> None:
    dense, sharded = GPT(plan.model, seed=plan.seed).to(ctx.device), GPT(plan.model, seed=plan.seed).to(ctx.device)
    bucket_mb = plan.layout.of(SyncOptions).bucket_mb
    variants = {
        "dp": DataParallel(dense, make_optimizer(dense, plan.lr, plan.weight_decay), ctx.comm("dp"), "bucketed",
                           bucket_mb),
        "ep": ExpertParallel(sharded, ctx.comm("dp"), ctx.comm("ep"), ctx.comm("edp"), "bucketed", bucket_mb,
                             plan.lr, plan.weight_decay),
    }
    timings, traffic = harness.alternate(ctx, variants, harness.Steps(plan, ctx, corpus), rounds, steps)
    for strategy in variants.values():
        strategy.close()
    sent = {name: summarize_traffic(t) for name, t in traffic.items()}
    # Every rank's bytes of its last step, to rank 0.
    mine = {name: (s["total"].sent_bytes, s["by_group"]) for name, s in sent.items()}
    per_rank = ctx.comm("world").gather_object(mine, 0, tag="tooling/bench")
    if ctx.is_rank0:
        report(plan, timings, rounds, steps, per_rank)


def report(plan, timings, rounds: int, steps: int, per_rank: list[dict]) -> None:
    uniform = ep_all_to_all_uniform_bytes(plan.model, plan.layout) * plan.dims.world_size
    print(f"\nmodel {plan.model.moe_experts} experts top-{plan.model.moe_top_k}, d_model={plan.model.d_model} "
          f"layers={plan.model.n_layers} seq={plan.model.seq_len} | world {plan.dims.world_size}, ep {plan.dims.ep} | "
          f"global batch {plan.global_batch}\n{harness.timing_note(rounds, steps)}")
    harness.print_timings(timings, plan.tokens_per_step, width=8)
    print(f"\n{'variant':<8} {'MB/step':>9} {'all-to-all MB':>14}  (every rank's last step)")
    for name in timings.measured():
        total = sum((r[name][0] for r in per_rank), Fraction(0))
        a2a = sum((r[name][1]["ep"].sent_bytes for r in per_rank if "ep" in r[name][1]), Fraction(0))
        print(f"{name:<8} {float(total) / 1e6:9.3f} {float(a2a) / 1e6:14.3f}")
    print()
    harness.print_ratio(timings, "ep", "dp")
    print(f"all-to-all under uniform routing: {float(uniform) / 1e6:.3f} MB per step")


if __name__ == "__main__":
    main()
