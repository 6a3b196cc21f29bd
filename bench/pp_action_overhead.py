"""The pipeline executor's cost per action, beside the chunk's compute, at small chunks.

    torchrun --standalone --nproc-per-node 2 -m bench.pp_action_overhead
    torchrun --standalone --nproc-per-node 2 -m bench.pp_action_overhead schedules=1f1b,zbv parallel.microbatches=16
    torchrun --standalone --nproc-per-node 4 -m bench.pp_action_overhead model=small parallel.microbatches=8

parallel/pp/executor.py walks each rank's action list in Python. Every action leaves a span in
the step's timeline (`PipelineParallel.spans`): a compute span (F, B, W: the chunk's own work), a
post span and a wait span (the sends and receives it posts together, per the posting plan of
parallel/pp/posting.py: under gloo's posting every receive at the step's start, each send where
it stands). What lies *between* two spans is the
executor's own Python: finding the action's chunk and tensors, the phase log, the microbatch
context, the span itself. Per schedule this prints, medians over the timed steps of rank 0:

    actions      compute actions + communication posts per step on rank 0
    compute ms   the chunk's compute per compute action (forward, backward or weight)
    gap us       the executor's time per action outside every span (the per-action overhead)
    gap/compute  that overhead as a share of one action's compute: what the critical path pays
    post us      one post of sends and receives (batch_isend_irecv through the log)
    wait ms      per step, waiting for receives and sends (the bubble and the peer's lateness)

Defaults: model=tiny, 8 microbatches of 2 sequences: small chunks, where overhead matters most.
Options are Hydra-style overrides of the training config, plus steps=N and schedules=a,b,c.
"""

from __future__ import annotations

import statistics
import sys

from bench import harness
from parallel.core.model import GPT
from parallel.dist.groups import LaunchEnv

PRESETS = {"gpipe": "pp_gpipe", "1f1b": "pp_1f1b", "interleaved": "pp_interleaved", "zbh1": "pp_zbh1",
           "zbv": "pp_zbv", "dualpipev": "pp_dualpipev"}
COMPUTE = ("forward", "backward", "weight")


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = harness.split_args(sys.argv[1:], {"steps": "6", "schedules": "gpipe,1f1b,zbv"})
    schedules = [s for s in opts["schedules"].split(",") if s]
    if any(s not in PRESETS for s in schedules):
        harness.refuse(env, f"schedules={opts['schedules']}: choose from {', '.join(PRESETS)}")
    defaults = ["model=tiny", "train.global_batch=16", "parallel.microbatches=8"]
    plans = {s: harness.plan_for(env, [*defaults, f"parallel={PRESETS[s]}"], overrides) for s in schedules}
    first = next(iter(plans.values()))
    harness.run_distributed(env, first, lambda plan, ctx, corpus: run(plans, ctx, corpus, int(opts["steps"])))


def step_figures(spans: list[dict]) -> dict:
    spans = sorted(spans, key=lambda s: s["start"])
    compute = [s["end"] - s["start"] for s in spans if s["kind"] in COMPUTE]
    posts = [s["end"] - s["start"] for s in spans if s["kind"] == "p2p"]
    gaps = [max(0.0, b["start"] - a["end"]) for a, b in zip(spans, spans[1:])]
    # One gap per action: a communication run is one action of the walk (a post and its wait).
    actions = len(compute) + len(posts)
    return {"actions": actions, "compute": statistics.median(compute), "gap": sum(gaps) / max(actions, 1),
            "post": statistics.median(posts) if posts else 0.0,
            "wait": sum(s["end"] - s["start"] for s in spans if s["kind"] == "wait")}


def run(plans: dict, ctx, corpus, steps: int) -> None:
    rows = {}
    for schedule, plan in plans.items():
        strategy = plan.spec.build(GPT(plan.model, seed=plan.seed).to(ctx.device), plan, ctx)
        batch = harness.Steps(plan, ctx, corpus)
        figures = []
        for step in range(steps + 1):  # step 0 warms up
            harness.timed_step(ctx, batch.of(strategy, step))
            if step:
                figures.append(step_figures(strategy.spans))
        strategy.close()
        rows[schedule] = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
    if ctx.is_rank0:
        plan = next(iter(plans.values()))
        print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} | pp {plan.dims.pp} | "
              f"m {plan.microbatches} x {plan.global_batch // plan.microbatches} sequences | rank 0, "
              f"medians of {steps} steps after a warm-up step | clock: the executor's spans (time.time, the wall)")
        print(f"{'schedule':<12} {'actions':>8} {'compute ms':>11} {'gap us':>8} {'gap/compute':>12} {'post us':>8} "
              f"{'wait ms':>8}")
        for s, r in rows.items():
            print(f"{s:<12} {r['actions']:8.0f} {r['compute'] * 1e3:11.2f} {r['gap'] * 1e6:8.0f} "
                  f"{r['gap'] / r['compute']:12.1%} {r['post'] * 1e6:8.0f} {r['wait'] * 1e3:8.1f}")


if __name__ == "__main__":
    main()
