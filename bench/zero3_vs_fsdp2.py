"""Hand-written ZeRO-3 against PyTorch FSDP2 (`fully_shard` per Block and on the root), in one run.

    torchrun --standalone --nproc-per-node 2 bench/zero3_vs_fsdp2.py                 # small model
    torchrun --standalone --nproc-per-node 4 bench/zero3_vs_fsdp2.py model=tiny rounds=3

Both variants live in the same processes and take turns (round-robin with a rotating start,
`steps` steps each per round), so machine noise and drift fall on both alike. Each variant's step
time is the median over its timed steps of the slowest rank. Printed: tokens/s of each and their
ratio, and per rank the model-state bytes each holds after a step (parameters, gradients, Adam
state, measured from the tensors) beside the ZeRO-3 formula 16·Ψ_pad/N, plus zero3's peak during a
step (its gathered parts included). Both send their collectives through the communication log;
the bytes per step are printed with theory's figure.
"""

from __future__ import annotations

import statistics
import sys
from fractions import Fraction
from functools import partial

from harness import plan_for, rotation, run_distributed, split_args, timed_step

from parallel import registry
from parallel.baselines.fsdp2 import TorchFSDP2
from parallel.core.data import GlobalBatches, local_microbatches
from parallel.core.model import GPT
from parallel.dist.comm import summarize_traffic
from parallel.dist.groups import LaunchEnv
from parallel.zero.zero3 import Zero3

FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = split_args(sys.argv[1:], {"rounds": "5", "steps": "4"})
    plan = plan_for(env, ["model=small", "parallel=zero3"], overrides)
    run_distributed(env, plan,
                    lambda plan, ctx, corpus: run(plan, ctx, corpus, int(opts["rounds"]), int(opts["steps"])))


def run(plan, ctx, corpus, rounds: int, steps: int) -> None:
    dp_comm = ctx.comm("dp")

    def fresh_model():
        return GPT(plan.model, seed=plan.seed).to(ctx.device)

    variants = {
        "zero3": Zero3(fresh_model(), dp_comm, plan.lr, plan.weight_decay),
        "torch_fsdp2": TorchFSDP2(fresh_model(), ctx.mesh["dp"], dp_comm, plan.lr, plan.weight_decay),
    }
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    traffic = {}
    step = 0
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        for name in rotation(list(variants), r):
            strategy = variants[name]
            for _ in range(steps):
                glob = batches(step)
                mbs = [mb.to(ctx.device)
                       for mb in local_microbatches(glob, ctx.coords["dp"], plan.dims.dp, plan.microbatches)]
                seconds, _, traffic[name] = timed_step(ctx, partial(strategy.train_step, mbs, glob.n_tokens))
                if r > 0 and ctx.is_rank0:
                    times[name].append(seconds)
                step += 1
    memory = {name: s.memory_report() for name, s in variants.items()}
    sent = {name: summarize_traffic(t)["total"].sent_bytes for name, t in traffic.items()}
    for strategy in variants.values():
        strategy.close()
    gathered = ctx.comm("world").gather_object({"memory": memory, "sent": sent}, 0, tag="tooling/bench")
    if ctx.is_rank0:
        report(plan, times, rounds, steps, gathered)


def report(plan, times: dict[str, list[float]], rounds: int, steps: int, per_rank: list[dict]) -> None:
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens, n = plan.tokens_per_step, plan.dims.dp
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"world {plan.dims.world_size} | global batch {plan.global_batch} | {plan.microbatches} microbatch(es) | "
          f"{rounds} rounds x {steps} steps per variant (medians of the slowest rank)")
    print(f"{'variant':<12} {'step ms':>9} {'tokens/s':>10} {'sent MB/step (all ranks)':>26} {'theory':>10}")
    for name, seconds in med.items():
        sent = sum(Fraction(r["sent"][name]) for r in per_rank)
        expected = Fraction(registry.expected_comm(name, plan.model, plan.dims,
                                                 microbatches=plan.microbatches)["sent_bytes_per_step_exact"])
        print(f"{name:<12} {seconds * 1e3:9.1f} {tokens / seconds:10.0f} {float(sent) / 1e6:26.3f} "
              f"{float(expected) / 1e6:10.3f}{'' if sent == expected else '  MISMATCH'}")
    print(f"\nzero3 / torch_fsdp2 tokens/s ratio: {med['torch_fsdp2'] / med['zero3']:.3f}  "
          "(>1: hand-written zero3 is faster)")
    formula = registry.model_state_bytes("zero3", plan.model, plan.dims)
    print("\nmodel state per rank, bytes (params + grads + Adam state; "
          f"formula 16·Ψ_pad/N = {formula['total_bytes']:,}, Ψ_pad = {formula['parameters_counted']:,}, N = {n}):")
    print(f"{'rank':>4} {'zero3':>12} {'zero3 peak':>12} {'torch_fsdp2':>12}   "
          "(zero3 params/grads/optimizer | fsdp2 params/grads/optimizer)")
    for rank, r in enumerate(per_rank):
        z, f = r["memory"]["zero3"], r["memory"]["torch_fsdp2"]
        print(f"{rank:>4} {sum(z[k] for k in FIELDS):>12,} {z['peak_model_state_bytes']:>12,} "
              f"{sum(f[k] for k in FIELDS):>12,}   "
              f"{'/'.join(f'{z[k]:,}' for k in FIELDS)} | {'/'.join(f'{f[k]:,}' for k in FIELDS)}")


if __name__ == "__main__":
    main()
