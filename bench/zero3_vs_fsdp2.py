"""Hand-written ZeRO-3 against PyTorch FSDP2 (`fully_shard` per Block and on the root), in one run.

    torchrun --standalone --nproc-per-node 2 -m bench.zero3_vs_fsdp2                 # small model
    torchrun --standalone --nproc-per-node 4 -m bench.zero3_vs_fsdp2 model=tiny rounds=3

The two take turns in the same processes (bench/harness.py: `alternate`). Printed: each one's step
time and tokens/s and their ratio, and per rank the model-state bytes each holds after a step
(parameters, gradients, Adam state, measured from the tensors) beside the ZeRO-3 formula
16·Ψ_pad/N, plus zero3's peak during a step (its gathered parts included). Both send their
collectives through the communication log; the bytes per step are printed with theory's figure.
Options are Hydra-style overrides of the training config, plus rounds=N and steps=N.
"""

from __future__ import annotations

import sys
from fractions import Fraction

from bench import harness
from parallel import registry
from parallel.baselines.fsdp2 import TorchFSDP2
from parallel.core.model import GPT
from parallel.dist.comm import summarize_traffic
from parallel.dist.groups import LaunchEnv
from parallel.zero.zero3 import Zero3

FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = harness.split_args(sys.argv[1:], {"rounds": "5", "steps": "4"})
    plan = harness.plan_for(env, ["model=small", "parallel=zero3"], overrides)
    harness.run_distributed(env, plan,
                            lambda plan, ctx, corpus: run(plan, ctx, corpus, int(opts["rounds"]), int(opts["steps"])))


def run(plan, ctx, corpus, rounds: int, steps: int) -> None:
    dp_comm = ctx.comm("dp")

    def fresh_model():
        return GPT(plan.model, seed=plan.seed).to(ctx.device)

    variants = {
        "zero3": Zero3(fresh_model(), dp_comm, plan.lr, plan.weight_decay),
        "torch_fsdp2": TorchFSDP2(fresh_model(), ctx.mesh["dp"], dp_comm, plan.lr, plan.weight_decay),
    }
    timings, traffic = harness.alternate(ctx, variants, harness.Steps(plan, ctx, corpus), rounds, steps)
    memory = {name: s.memory_report() for name, s in variants.items()}
    sent = {name: summarize_traffic(t)["total"].sent_bytes for name, t in traffic.items()}
    for strategy in variants.values():
        strategy.close()
    gathered = ctx.comm("world").gather_object({"memory": memory, "sent": sent}, 0, tag="tooling/bench")
    if ctx.is_rank0:
        report(plan, timings, rounds, steps, gathered)


def report(plan, timings, rounds: int, steps: int, per_rank: list[dict]) -> None:
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"world {plan.dims.world_size} | global batch {plan.global_batch} | {plan.microbatches} microbatch(es)\n"
          f"{harness.timing_note(rounds, steps)}")
    harness.print_timings(timings, plan.tokens_per_step)
    print(f"\n{'variant':<12} {'sent MB/step (all ranks)':>26} {'theory':>10}")
    for name in timings.measured():
        sent = sum(Fraction(r["sent"][name]) for r in per_rank)
        expected = Fraction(registry.expected_comm(name, plan.model, plan.dims,
                                                 microbatches=plan.microbatches)["sent_bytes_per_step_exact"])
        print(f"{name:<12} {float(sent) / 1e6:26.3f} {float(expected) / 1e6:10.3f}"
              f"{'' if sent == expected else '  MISMATCH'}")
    print()
    harness.print_ratio(timings, "zero3", "torch_fsdp2")
    memory_table(plan, per_rank)


def memory_table(plan, per_rank: list[dict]) -> None:
    formula = registry.model_state_bytes("zero3", plan.model, plan.dims)
    print("\nmodel state per rank, bytes (params + grads + Adam state; "
          f"formula 16·Ψ_pad/N = {formula['total_bytes']:,}, Ψ_pad = {formula['parameters_counted']:,}, "
          f"N = {plan.dims.dp}):")
    print(f"{'rank':>4} {'zero3':>12} {'zero3 peak':>12} {'torch_fsdp2':>12}   "
          "(zero3 params/grads/optimizer | fsdp2 params/grads/optimizer)")
    for rank, r in enumerate(per_rank):
        z, f = r["memory"]["zero3"], r["memory"]["torch_fsdp2"]
        print(f"{rank:>4} {sum(z[k] for k in FIELDS):>12,} {z['peak_model_state_bytes']:>12,} "
              f"{sum(f[k] for k in FIELDS):>12,}   "
              f"{'/'.join(f'{z[k]:,}' for k in FIELDS)} | {'/'.join(f'{f[k]:,}' for k in FIELDS)}")


if __name__ == "__main__":
    main()
