"""Hand-written pipeline schedules against torch.distributed.pipelining, in one run.

    torchrun --standalone --nproc-per-node 4 bench/pp_vs_torch.py parallel.microbatches=8     # pp 4, small model
    torchrun --standalone --nproc-per-node 4 bench/pp_vs_torch.py parallel.microbatches=8 rounds=4 steps=2
    torchrun --standalone --nproc-per-node 2 bench/pp_vs_torch.py model=tiny schedules=gpipe,1f1b
    torchrun --standalone --nproc-per-node 4 bench/pp_vs_torch.py parallel.microbatches=8 schedules=zbh1,zbv,dualpipev

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

All variants live in the same processes and take turns (round-robin with a rotating start, `steps`
steps each per round; round 0 warms up and is not timed), so machine noise falls on all alike. Each
variant walks its own step counter through the same global batches, so variants see identical data
in identical order and their first losses can be compared step by step. A step time is the slowest
rank's; the printed figures are medians, and the ratios compare medians measured in this one run.

Options are Hydra-style key=value overrides of the training config (model=..., parallel.microbatches=...,
train.global_batch=...), plus rounds=N, steps=N and schedules=a,b,c for the benchmark itself, and
profile=1: each variant's timed steps under cProfile on rank 0, its top functions by own time printed.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch
from harness import Profiles, plan_for, refuse, rotation, run_distributed, split_args, timed_step

from parallel.core.data import GlobalBatches, local_microbatches
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
    overrides, opts = split_args(sys.argv[1:], {"rounds": "5", "steps": "4", "schedules": "gpipe,1f1b,interleaved",
                                                "profile": "0"})
    schedules = [s for s in opts["schedules"].split(",") if s]
    unknown = [s for s in schedules if s not in PAIRS]
    if unknown:
        refuse(env, f"schedules={opts['schedules']}: unknown {unknown}; choose from {', '.join(PAIRS)}")
    # Every variant's plan, validated before any process group exists (as launch.train would).
    plans, skipped = {}, {}
    for s in schedules:
        for side, preset in zip(("ours", "torch"), PAIRS[s]):
            try:
                plans[f"{side}_{s}"] = plan_for(env, ["model=small", f"parallel={preset}"], overrides)
            except ValueError as e:  # plan.py's refusals (a schedule that needs more microbatches, ...)
                skipped[f"{side}_{s}"] = str(e)
    if not plans:
        refuse(env, "no schedule can run with these settings: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    first = next(iter(plans.values()))
    if first.dims.dp != 1:
        refuse(env, f"the benchmark is one pipeline (pp = world size): got dp {first.dims.dp}; leave parallel.dp out")
    rounds, steps = int(opts["rounds"]), int(opts["steps"])
    profiles = Profiles(opts["profile"] == "1" and env.rank == 0)
    run_distributed(env, first,
                    lambda plan, ctx, corpus: run(plans, skipped, ctx, corpus, rounds, steps, schedules, profiles))


def run(plans: dict, skipped: dict, ctx, corpus, rounds: int, steps: int, schedules: list[str],
        profiles: Profiles) -> None:
    plan = next(iter(plans.values()))
    pp_comm = ctx.comm("pp")
    variants = {name: p.spec.build(GPT(p.model, seed=p.seed).to(ctx.device), p, ctx) for name, p in plans.items()}

    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    norms: dict[str, list[float]] = {name: [] for name in names}
    counter = {name: 0 for name in names}  # each variant walks the same batches in the same order
    for r in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for name in rotation(names, r):
            strategy = variants[name]
            for _ in range(steps):
                glob = batches(counter[name])
                counter[name] += 1
                mbs = [mb.to(ctx.device) for mb in local_microbatches(glob, 0, 1, plans[name].microbatches)]
                step = partial(strategy.train_step, mbs, glob.n_tokens)
                timed = partial(profiles.around, name, step) if r > 0 else step
                seconds, local, _ = timed_step(ctx, timed)
                # Outside the timed region: the loss lives on the last stage only; sum it over pp.
                # Also the global gradient norm the optimizer used (Adam would hide a 1/m scaling
                # of the gradients from the losses; the norm shows it).
                sq = sum(float(q.grad.double().pow(2).sum())
                         for c in strategy.chunks for q in c.parameters() if q.grad is not None)
                pair = torch.stack([local.detach().double(), torch.tensor(sq, dtype=torch.float64)])
                pp_comm.all_reduce(pair, tag="tooling/loss")
                if ctx.is_rank0:
                    losses[name].append(float(pair[0]))
                    norms[name].append(float(pair[1]) ** 0.5)
                    if r > 0:
                        times[name].append(seconds)
    for strategy in variants.values():
        strategy.close()
    if ctx.is_rank0:
        report(plans, schedules, times, losses, norms, skipped, rounds, steps)
        profiles.report()


def round_ratios(ours: list[float], theirs: list[float], steps: int) -> list[float]:
    """torch's median step over ours, round by round (each list holds `steps` timed steps per round)."""
    rounds = min(len(ours), len(theirs)) // steps
    return [statistics.median(theirs[r * steps:(r + 1) * steps]) / statistics.median(ours[r * steps:(r + 1) * steps])
            for r in range(rounds)]


def report(plans, schedules, times, losses, norms, skipped, rounds: int, steps: int) -> None:
    plan = next(iter(plans.values()))
    med = {name: statistics.median(t) for name, t in times.items() if t}
    tokens = plan.tokens_per_step
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"pp {plan.dims.pp} | microbatches (m) per schedule: "
          f"{', '.join(f'{s} {plans[k].microbatches}' for s in schedules for k in [f'ours_{s}'] if k in plans)} | "
          f"global batch {plan.global_batch} | torch {torch.__version__} | "
          f"{rounds} rounds x {steps} steps per variant (medians of the slowest rank)")
    print(f"{'schedule':<17} {'ours ms':>9} {'ours tok/s':>11} {'torch ms':>9} {'torch tok/s':>12} "
          f"{'ours/torch tok/s':>17} {'rounds min-max':>15}")
    for s in schedules:
        o, t = med.get(f"ours_{s}"), med.get(f"torch_{s}")
        spread = round_ratios(times.get(f"ours_{s}", []), times.get(f"torch_{s}", []), steps)
        cells = [f"{o * 1e3:9.1f}" if o else f"{'-':>9}", f"{tokens / o:11.0f}" if o else f"{'-':>11}",
                 f"{t * 1e3:9.1f}" if t else f"{'-':>9}", f"{tokens / t:12.0f}" if t else f"{'-':>12}",
                 f"{t / o:17.3f}" if o and t else f"{'-':>17}",
                 f"{min(spread):.3f}-{max(spread):.3f}".rjust(15) if len(spread) > 1 else f"{'-':>15}"]
        print(f"{s:<17} " + " ".join(cells))
    print("(ours/torch > 1: the hand-written pipeline is faster; rounds min-max: the same ratio of medians "
          "taken round by round, the two variants seconds apart in the same processes)")
    print(f"\nloss check, first {LOSS_STEPS} steps (same seed and data; relative difference ours vs torch):")
    for s in schedules:
        o, t = losses.get(f"ours_{s}", []), losses.get(f"torch_{s}", [])
        if not o or not t:
            continue
        pairs = list(zip(o[:LOSS_STEPS], t[:LOSS_STEPS]))
        cells = "  ".join(f"{a:.6f}/{b:.6f}" for a, b in pairs)
        worst = max(abs(a - b) / abs(a) for a, b in pairs)
        gn_o, gn_t = norms[f"ours_{s}"][:LOSS_STEPS], norms[f"torch_{s}"][:LOSS_STEPS]
        gworst = max(abs(a - b) / abs(a) for a, b in zip(gn_o, gn_t))
        print(f"  {s:<17} loss ours/torch {cells}   max rel diff {worst:.1e} | "
              f"grad norm step 0 {gn_o[0]:.5f}/{gn_t[0]:.5f}, max rel diff {gworst:.1e}")
    ours = [losses[f"ours_{s}"][:LOSS_STEPS] for s in schedules if f"ours_{s}" in losses]
    if len(ours) > 1:
        spread = max(abs(a - b) / abs(b) for row in ours[1:] for a, b in zip(row, ours[0]))
        print(f"  ours across schedules: max rel diff {spread:.1e}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")


if __name__ == "__main__":
    main()
