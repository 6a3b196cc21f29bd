"""Hand-written pipeline schedules against torch.distributed.pipelining, in one run.

    torchrun --standalone --nproc-per-node 4 -m bench.pp_vs_torch parallel.microbatches=8     # pp 4, small model
    torchrun --standalone --nproc-per-node 4 -m bench.pp_vs_torch parallel.microbatches=8 rounds=4 steps=2
    torchrun --standalone --nproc-per-node 2 -m bench.pp_vs_torch model=tiny schedules=gpipe,1f1b
    torchrun --standalone --nproc-per-node 4 -m bench.pp_vs_torch parallel.microbatches=8 schedules=zbh1,zbv,dualpipev

The world is one pipeline (pp = world size, dp = 1). For each schedule two variants are built from
the same seed, each exactly as `launch.train` builds its preset (the registry's builder, on a plan
validated by plan.py), with the same stage split and the same m microbatches of the same batches:

    ours_<schedule>    parallel=pp_<schedule>: the project's action lists (parallel/pp/executor.py)
    torch_<schedule>   its PyTorch counterpart, parallel=torch_pp_<...>: torch.distributed.pipelining's
                       PipelineStage per chunk, driven by its own schedule class, sends counted

schedule in gpipe, 1f1b, interleaved (v = parallel.virtual_stages of the preset), zbh1 (PyTorch's
ScheduleInterleavedZeroBubble), zbv, dualpipev. Both end a step with the project's AdamW over the
rank's chunks. A schedule that plan.py refuses for this (p, m) is reported as skipped, with why.

Loss and gradients: every microbatch's loss is token_loss_sum / global batch tokens in both. torch's
schedules would by default divide the accumulated gradients by m (`scale_grads=True`: they assume a
loss_fn that averages within the microbatch); the torch variants pass `scale_grads=False`, so their
gradients, and so their losses from the second step on, equal ours. The step loss of a torch variant
is the sum of the m microbatch losses it returns on the last stage.

The variants take turns in the same processes (bench/harness.py: `alternate`); each walks its own
step counter through the same global batches, so they see identical data in identical order and
their first losses can be compared step by step.

Options are Hydra-style key=value overrides of the training config (model=..., parallel.microbatches=...,
train.global_batch=...), plus rounds=N, steps=N and schedules=a,b,c for the benchmark itself, and
profile=1: each variant's timed steps under cProfile on rank 0, its top functions by own time printed.
"""

from __future__ import annotations

import sys

import torch

from bench import harness
from parallel.core.model import GPT
from parallel.dist.groups import LaunchEnv

LOSS_STEPS = 3  # the first steps whose losses are compared


# Each schedule: our preset and its PyTorch counterpart's (conf/parallel/).
PAIRS = {
    "gpipe": ("pp_gpipe", "torch_pp_gpipe"),
    "1f1b": ("pp_1f1b", "torch_pp_1f1b"),
    "interleaved": ("pp_interleaved", "torch_pp_interleaved"),
    "zbh1": ("pp_zbh1", "torch_pp_interleaved_zb"),
    "zbv": ("pp_zbv", "torch_pp_zbv"),
    "dualpipev": ("pp_dualpipev", "torch_pp_dualpipev"),
}


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = harness.split_args(sys.argv[1:], {"rounds": "5", "steps": "4",
                                                        "schedules": "gpipe,1f1b,interleaved", "profile": "0"})
    schedules = [s for s in opts["schedules"].split(",") if s]
    unknown = [s for s in schedules if s not in PAIRS]
    if unknown:
        harness.refuse(env, f"schedules={opts['schedules']}: unknown {unknown}; choose from {', '.join(PAIRS)}")
    plans, skipped = plans_for(env, schedules, overrides)
    if not plans:
        harness.refuse(env, "no schedule can run with these settings: "
                       + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    first = next(iter(plans.values()))
    if first.dims.dp != 1:
        harness.refuse(env, f"the benchmark is one pipeline (pp = world size): got dp {first.dims.dp}; "
                       "leave parallel.dp out")
    rounds, steps = int(opts["rounds"]), int(opts["steps"])
    profiles = harness.Profiles(opts["profile"] == "1" and env.rank == 0)
    harness.run_distributed(env, first, lambda plan, ctx, corpus: run(plans, skipped, ctx, corpus, rounds, steps,
                                                                      schedules, profiles))


def plans_for(env, schedules: list[str], overrides: list[str]) -> tuple[dict, dict]:
    """Every variant's plan, validated before any process group exists (as launch.train would), and
    the variants plan.py refuses (a schedule that needs more microbatches, ...) with why."""
    plans, skipped = {}, {}
    for s in schedules:
        for side, preset in zip(("ours", "torch"), PAIRS[s]):
            try:
                plans[f"{side}_{s}"] = harness.plan_for(env, ["model=small", f"parallel={preset}"], overrides)
            except ValueError as e:
                skipped[f"{side}_{s}"] = str(e)
    return plans, skipped


def run(plans: dict, skipped: dict, ctx, corpus, rounds: int, steps: int, schedules: list[str],
        profiles: harness.Profiles) -> None:
    plan = next(iter(plans.values()))
    pp_comm = ctx.comm("pp")
    variants = {name: p.spec.build(GPT(p.model, seed=p.seed).to(ctx.device), p, ctx) for name, p in plans.items()}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    norms: dict[str, list[float]] = {name: [] for name in variants}

    def after(name: str, local_loss) -> None:
        # The loss lives on the last stage only: summed over pp. Also the global gradient norm the
        # optimizer used (Adam would hide a 1/m scaling of the gradients from the losses; the norm shows it).
        sq = sum(float(q.grad.double().pow(2).sum())
                 for c in variants[name].chunks for q in c.parameters() if q.grad is not None)
        pair = torch.stack([local_loss.detach().double(), torch.tensor(sq, dtype=torch.float64)])
        pp_comm.all_reduce(pair, tag="tooling/loss")
        losses[name].append(float(pair[0]))
        norms[name].append(float(pair[1]) ** 0.5)

    microbatches = {name: p.microbatches for name, p in plans.items()}
    timings, _ = harness.alternate(ctx, variants, harness.Steps(plan, ctx, corpus), rounds, steps,
                                   microbatches=microbatches, after=after, profiles=profiles)
    for strategy in variants.values():
        strategy.close()
    if ctx.is_rank0:
        report(plans, schedules, timings, rounds, steps)
        print_losses(schedules, losses, norms)
        for name, why in skipped.items():
            print(f"skipped {name}: {why}")
        profiles.report()


def cells(timings: harness.Timings, s: str, tokens: int) -> list[str]:
    """One schedule's row: ours and torch's step and tokens/s, and their ratio with its rounds' range."""
    measured = timings.measured()
    o = timings.median(f"ours_{s}") if f"ours_{s}" in measured else None
    t = timings.median(f"torch_{s}") if f"torch_{s}" in measured else None
    ratio = str(timings.ratio(f"ours_{s}", f"torch_{s}")) if o and t else "-"
    return [f"{o * 1e3:9.1f}" if o else f"{'-':>9}", f"{tokens / o:11.0f}" if o else f"{'-':>11}",
            f"{t * 1e3:9.1f}" if t else f"{'-':>9}", f"{tokens / t:12.0f}" if t else f"{'-':>12}", f"{ratio:>30}"]


def report(plans, schedules, timings: harness.Timings, rounds: int, steps: int) -> None:
    plan = next(iter(plans.values()))
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"pp {plan.dims.pp} | microbatches (m) per schedule: "
          f"{', '.join(f'{s} {plans[k].microbatches}' for s in schedules for k in [f'ours_{s}'] if k in plans)} | "
          f"global batch {plan.global_batch} | torch {torch.__version__}\n{harness.timing_note(rounds, steps)}")
    print(f"{'schedule':<17} {'ours ms':>9} {'ours tok/s':>11} {'torch ms':>9} {'torch tok/s':>12} "
          f"{'ours/torch tok/s (rounds)':>30}")
    for s in schedules:
        print(f"{s:<17} " + " ".join(cells(timings, s, plan.tokens_per_step)))
    print("(ours/torch > 1: the hand-written pipeline is faster; rounds: the same ratio of medians taken round "
          "by round, the two variants seconds apart in the same processes)")


def print_losses(schedules: list[str], losses: dict, norms: dict) -> None:
    print(f"\nloss check, first {LOSS_STEPS} steps (same seed and data; relative difference ours vs torch):")
    for s in schedules:
        o, t = losses.get(f"ours_{s}", []), losses.get(f"torch_{s}", [])
        if not o or not t:
            continue
        pairs = list(zip(o[:LOSS_STEPS], t[:LOSS_STEPS]))
        shown = "  ".join(f"{a:.6f}/{b:.6f}" for a, b in pairs)
        worst = max(abs(a - b) / abs(a) for a, b in pairs)
        gn_o, gn_t = norms[f"ours_{s}"][:LOSS_STEPS], norms[f"torch_{s}"][:LOSS_STEPS]
        gworst = max(abs(a - b) / abs(a) for a, b in zip(gn_o, gn_t))
        print(f"  {s:<17} loss ours/torch {shown}   max rel diff {worst:.1e} | "
              f"grad norm step 0 {gn_o[0]:.5f}/{gn_t[0]:.5f}, max rel diff {gworst:.1e}")
    ours = [losses[f"ours_{s}"][:LOSS_STEPS] for s in schedules if losses.get(f"ours_{s}")]
    if len(ours) > 1:
        spread = max(abs(a - b) / abs(b) for row in ours[1:] for a, b in zip(row, ours[0]))
        print(f"  ours across schedules: max rel diff {spread:.1e}")


if __name__ == "__main__":
    main()
