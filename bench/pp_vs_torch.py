"""Hand-written pipeline schedules against torch.distributed.pipelining, in one run.

    torchrun --standalone --nproc-per-node 4 bench/pp_vs_torch.py parallel.microbatches=8     # pp 4, small model
    torchrun --standalone --nproc-per-node 4 bench/pp_vs_torch.py parallel.microbatches=8 rounds=4 steps=2
    torchrun --standalone --nproc-per-node 2 bench/pp_vs_torch.py model=tiny schedules=gpipe,1f1b

The world is one pipeline (pp = world size, dp = 1). For each schedule two variants are built from
the same seed, with the same stage split (`split_model`: rank r holds virtual stages r, r+p, ...)
and the same m microbatches of the same global batches:

    ours_<schedule>    parallel.pp.executor.PipelineParallel (the project's action lists)
    torch_<schedule>   parallel/baselines/pipelining.py's TorchPipeline (as train.py builds parallel=torch_pp_*):
                       one PipelineStage per chunk of this rank (stage_index = the chunk's virtual
                       stage, num_stages = p*v, the pp group), driven by ScheduleGPipe /
                       Schedule1F1B / ScheduleInterleaved1F1B, its sends counted by native_count.py

with schedule in gpipe, 1f1b, interleaved_1f1b (v virtual stages per rank, default 2). Both end a
step with the project's AdamW (`make_optimizer`) over the rank's chunks.

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
train.global_batch=...), plus rounds=N, steps=N, schedules=a,b,c and virtual=V for the benchmark itself.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch
from harness import plan_for, refuse, rotation, run_distributed, split_args, timed_step

from parallel.baselines.pipelining import SCHEDULES as ALL_SCHEDULES
from parallel.baselines.pipelining import TorchPipeline
from parallel.data import GlobalBatches, local_microbatches
from parallel.dist.groups import LaunchEnv
from parallel.model import GPT
from parallel.pp.executor import PipelineParallel
from parallel.pp.schedules import ScheduleError, build_schedule

LOSS_STEPS = 3  # the first steps whose losses are compared


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = split_args(sys.argv[1:], {"rounds": "5", "steps": "4", "schedules": ",".join(ALL_SCHEDULES),
                                                "virtual": "2"})
    schedules = [s for s in opts["schedules"].split(",") if s]
    unknown = [s for s in schedules if s not in ALL_SCHEDULES]
    if unknown:
        refuse(env, f"schedules={opts['schedules']}: unknown {unknown}; choose from {', '.join(ALL_SCHEDULES)}")
    plan = plan_for(env, ["model=small", "parallel=pp_1f1b"], overrides)
    if plan.strategy != "pp" or plan.dims.dp != 1:
        refuse(env, f"this benchmark needs one pipeline over the whole world (pp = world, dp = 1), "
                    f"got strategy {plan.strategy}, dp {plan.dims.dp}: launch it with torchrun and >= 2 processes")
    run_distributed(env, plan, lambda plan, ctx, corpus: run(plan, ctx, corpus, int(opts["rounds"]), int(opts["steps"]),
                                                             schedules, int(opts["virtual"])))


def run(plan, ctx, corpus, rounds: int, steps: int, schedules: list[str], virtual: int) -> None:
    pp_comm = ctx.comm("pp")
    p, m = plan.dims.pp, plan.microbatches
    variants: dict[str, object] = {}
    skipped: dict[str, str] = {}
    for schedule in schedules:
        v = virtual if schedule == "interleaved_1f1b" else 1
        layers = list(plan.pp_layers) if plan.pp_layers and len(plan.pp_layers) == p * v else None
        try:
            build_schedule(schedule, p, m, v)  # the same (p, m, v) checks the trainer makes
        except ScheduleError as e:
            skipped[f"ours_{schedule}"] = skipped[f"torch_{schedule}"] = str(e)
            continue
        variants[f"ours_{schedule}"] = PipelineParallel(
            GPT(plan.model, seed=plan.seed).to(ctx.device), pp_comm=pp_comm, dp_comm=ctx.comm("dp"),
            schedule=schedule, microbatches=m, virtual=v, pp_layers=layers, lr=plan.lr, weight_decay=plan.weight_decay,
        )
        try:
            variants[f"torch_{schedule}"] = TorchPipeline(
                GPT(plan.model, seed=plan.seed).to(ctx.device), schedule, pp_comm, m, v, layers,
                plan.lr, plan.weight_decay, ctx.device, ctx.log,
            )
        except Exception as e:  # construction is deterministic: every rank fails alike, nobody hangs
            skipped[f"torch_{schedule}"] = f"{type(e).__name__}: {e}"

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
                mbs = [mb.to(ctx.device) for mb in local_microbatches(glob, 0, 1, m)]
                seconds, local, _ = timed_step(ctx, partial(strategy.train_step, mbs, glob.n_tokens))
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
        report(plan, schedules, virtual, times, losses, norms, skipped, rounds, steps)


def report(plan, schedules, virtual, times, losses, norms, skipped, rounds: int, steps: int) -> None:
    med = {name: statistics.median(t) for name, t in times.items() if t}
    tokens = plan.tokens_per_step
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} seq={plan.model.seq_len} | "
          f"pp {plan.dims.pp} | microbatches {plan.microbatches} x {plan.microbatch_size} sequences | "
          f"global batch {plan.global_batch} | interleaved v={virtual} | torch {torch.__version__} | "
          f"{rounds} rounds x {steps} steps per variant (medians of the slowest rank)")
    print(f"{'schedule':<17} {'ours ms':>9} {'ours tok/s':>11} {'torch ms':>9} {'torch tok/s':>12} "
          f"{'ours/torch tok/s':>17}")
    for s in schedules:
        o, t = med.get(f"ours_{s}"), med.get(f"torch_{s}")
        cells = [f"{o * 1e3:9.1f}" if o else f"{'-':>9}", f"{tokens / o:11.0f}" if o else f"{'-':>11}",
                 f"{t * 1e3:9.1f}" if t else f"{'-':>9}", f"{tokens / t:12.0f}" if t else f"{'-':>12}",
                 f"{t / o:17.3f}" if o and t else f"{'-':>17}"]
        print(f"{s:<17} " + " ".join(cells))
    print("(ours/torch > 1: the hand-written pipeline is faster)")
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
