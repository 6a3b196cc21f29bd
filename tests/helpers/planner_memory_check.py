"""Run under torchrun at world 4 by test_planner_memory.py: for every strategy the registry gives an
activation formula, the bytes saved for backward, measured on every rank, against the formula.

For each layout of LAYOUTS, in one job (each on its own device mesh over the same 4 processes): build
the strategy as launch.train does, train two steps under the ActivationMeter (train.py's meter:
saved-tensor hooks, distinct storages, parameters left out) and compare the last step's peak on
every rank with the registry's `activations` (parallel/activations.py) and the model state
each rank holds with the planner's `model_state_bytes` for its stage (for what the planner plans:
PyTorch's own baselines keep their model state their own way). Rank 0 prints one line per
layout: `<label> measured=[...] formula=[...] state=[...] state_formula=[...]`, then `done`.
Arguments: the model preset (tiny by default) and the labels of the layouts to run (all by default).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

# Run as a script: the project root must come first on the path (this checkout's code, not an installed one).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from launch.config import CONFIG_DIR  # noqa: E402
from parallel.core.data import GlobalBatches, load_corpus, local_microbatches  # noqa: E402
from parallel.core.model import GPT  # noqa: E402
from parallel.core.recompute import apply_recompute  # noqa: E402
from parallel.core.shape import ModelShape  # noqa: E402
from parallel.dist.comm import CommLog  # noqa: E402
from parallel.dist.groups import DistContext, LaunchEnv, add_layout_groups, exit_process, init_distributed, shutdown  # noqa: E402
from parallel.moe.stats import RoutingMeter  # noqa: E402
from parallel.planner.enumerate import zero_stage  # noqa: E402
from parallel.planner.memory import model_state_bytes  # noqa: E402
from parallel.planner.moe import sandbox_activation_bytes  # noqa: E402
from parallel.report.activations import ActivationMeter  # noqa: E402
from parallel.run_plan import build_plan  # noqa: E402

# (label, preset, overrides): every registry entry with a formula, pipelines and tp cut several ways (under
# sequence parallelism saving the column-parallel inputs whole or as pieces: parallel.tp_saves).
LAYOUTS = [
    ("single", "single", ["parallel.microbatches=2"]),
    ("dp m2", "dp", ["parallel.microbatches=2"]),
    ("zero1", "zero1", []),
    ("zero2 m2", "zero2", ["parallel.microbatches=2"]),
    ("zero3", "zero3", []),
    ("tp 2x2", "tp", []),
    ("tp_sp tp4", "tp_sp", ["parallel.tp=4"]),
    ("tp_sp 2x2", "tp_sp", []),
    ("tp_sp 2x2 sharded", "tp_sp", ["parallel.tp_saves=sharded"]),
    ("pp_gpipe p4", "pp_gpipe", []),
    ("pp_1f1b dp2 p2 m4", "pp_1f1b", ["parallel.dp=2"]),
    ("pp_interleaved p4 v2", "pp_interleaved", []),
    ("3d tp2 pp2 sp m4", "3d", ["parallel.sequence_parallel=true"]),
    ("3d tp2 pp2 sp sharded m4", "3d", ["parallel.sequence_parallel=true", "parallel.tp_saves=sharded"]),
    ("3d tp2 dp2 zero1", "3d", ["parallel.pp=1", "parallel.zero=1", "parallel.microbatches=2"]),
    # ZeRO-2 completing sequence parallelism's partial gradients, and on a pipeline's two chunks.
    ("3d tp2 dp2 sp zero2", "3d", ["parallel.pp=1", "parallel.zero=2", "parallel.sequence_parallel=true",
                                   "parallel.microbatches=2"]),
    ("pp_interleaved dp2 p2 v2 zero2", "pp_interleaved", ["parallel.dp=2", "parallel.zero=2"]),
    # Recomputation on a pipeline's walk and over tp: what each block keeps, and its backward's recomputed set.
    ("pp_1f1b p4 full", "pp_1f1b", ["train.recompute=full"]),
    ("pp_interleaved p4 v2 selective", "pp_interleaved", ["train.recompute=selective"]),
    ("3d tp2 pp2 sp sharded selective m4", "3d", ["parallel.sequence_parallel=true", "parallel.tp_saves=sharded",
                                                  "train.recompute=selective"]),
    ("3d tp2 pp2 sp full m4", "3d", ["parallel.sequence_parallel=true", "train.recompute=full"]),
    ("tp_sp 2x2 sharded full", "tp_sp", ["parallel.tp_saves=sharded", "train.recompute=full"]),
    ("tp 2x2 selective", "tp", ["train.recompute=selective"]),
    # Split backwards: a chunk's saved tensors held until W (its loss's released by B); the V placement.
    ("zbh1 dp2 p2 m4", "pp_1f1b", ["parallel.schedule=zbh1", "parallel.dp=2", "parallel.microbatches=4"]),
    ("zbv p4 m8", "pp_1f1b", ["parallel.schedule=zbv", "parallel.microbatches=8", "parallel.virtual_stages=2"]),
    ("3d tp2 pp2 zbh1 m4", "3d", ["parallel.schedule=zbh1", "parallel.grad_sync=naive"]),
    # The pieces kept to W, where they are gathered again for the weight gradients.
    ("3d tp2 pp2 sp sharded zbh1 m4", "3d", ["parallel.schedule=zbh1", "parallel.grad_sync=naive",
                                            "parallel.sequence_parallel=true", "parallel.tp_saves=sharded"]),
    # Recomputation in B, beside everything the chunk keeps for W (the first virtual stage's W is whole).
    ("zbh1 dp2 p2 m4 selective", "pp_1f1b", ["parallel.schedule=zbh1", "parallel.dp=2", "parallel.microbatches=4",
                                             "train.recompute=selective"]),
    ("zbv p4 m8 full", "pp_1f1b", ["parallel.schedule=zbv", "parallel.microbatches=8", "parallel.virtual_stages=2",
                                   "train.recompute=full"]),
    ("3d tp2 pp2 sp zbh1 full m4", "3d", ["parallel.schedule=zbh1", "parallel.grad_sync=naive",
                                          "parallel.sequence_parallel=true", "train.recompute=full"]),
    ("dualpipev p4 m8", "pp_1f1b", ["parallel.schedule=dualpipev", "parallel.microbatches=8",
                                    "parallel.virtual_stages=2"]),
    ("torch_ddp", "torch_ddp", []),
    ("accelerate_ddp", "accelerate_ddp", []),
    ("torch_fsdp2", "torch_fsdp2", []),
]
# A mixture of experts (model=tiny_moe): its layouts, each checked against the planner's MoE formula
# (parallel/planner/moe.py) with the routing the run measured.
MOE_LAYOUTS = [
    ("ep 4x2 m2", "ep", ["parallel.ep=2", "parallel.microbatches=2"]),
    ("ep4", "ep", []),
]
COMMON = ["model.n_layers=8", "train.global_batch=8", "data.max_bytes=100000", "train.steps=2", "train.warmup_steps=0"]


def requested(argv: list[str]) -> tuple[str, list[tuple[str, str, list[str]]]]:
    """`planner_memory_check.py [model [label ...]]`: the conf/model/ preset (tiny by default) and the
    layouts of LAYOUTS to run, by label (every one by default)."""
    model, labels = (argv[0] if argv else "tiny"), argv[1:]
    every = LAYOUTS + MOE_LAYOUTS
    unknown = set(labels) - {label for label, _, _ in every}
    if unknown:
        raise SystemExit(f"no layout labelled {sorted(unknown)} in LAYOUTS or MOE_LAYOUTS")
    return model, [layout for layout in (every if labels else LAYOUTS) if not labels or layout[0] in labels]


def activation_formula(plan, reports: list[dict]) -> list[int] | None:
    """The registry's formula; for a mixture of experts the planner's, on the routing each rank measured."""
    if not plan.model.moe_experts:
        return plan.spec.activations(plan.model, plan.layout)
    ranks = plan.dims.world_size
    routing = tuple(tuple(tuple(call["kept"]) for call in r["routing"]) for r in reports[:ranks])
    return sandbox_activation_bytes(ModelShape(gpt=plan.model), replace(plan.layout, routing=routing))


def plan_for(model: str, preset: str, extra: list[str], world: int):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", *COMMON, f"parallel={preset}", *extra])
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    return build_plan(cfg, env, cuda_available=False)


def main() -> None:
    env = LaunchEnv.from_environ()
    torch.set_num_threads(1)
    model, layouts = requested(sys.argv[1:])
    plans = [(label, plan_for(model, preset, extra, 1 if preset == "single" else env.world_size))
             for label, preset, extra in layouts]
    first = plans[0][1]
    corpus = load_corpus(None, first.data_max_bytes, first.model.seq_len + 1)
    batches = GlobalBatches(corpus, first.model.seq_len, first.global_batch, first.seed)
    base = init_distributed(env, next(p.dims for _, p in plans if p.dims.world_size > 1), "gloo", 60.0, CommLog())
    contexts = {base.dims: base}
    world = base.comm("world")
    for label, plan in plans:
        if plan.dims.world_size == 1:  # one process: every rank runs it alone, with no group
            ctx = DistContext(env=LaunchEnv(), dims=plan.dims, backend=None, device=base.device, log=base.log)
        else:
            if plan.dims not in contexts:
                contexts[plan.dims] = add_layout_groups(DistContext(env=env, dims=plan.dims, backend="gloo",
                                                                    device=base.device, log=base.log))
            ctx = contexts[plan.dims]
        model = GPT(plan.model, seed=plan.seed)
        strategy = plan.spec.build(model, plan, ctx)
        apply_recompute(model, plan.layout.recompute, strategy.phases)  # as launch.train: after the strategy
        meter, routing = ActivationMeter(strategy.model.parameters()), RoutingMeter(strategy.model)
        for step in range(2):
            batch = batches(step)
            local = local_microbatches(batch, ctx.coords["dp"], plan.dims.dp, plan.microbatches)
            with meter.step(), routing.step():
                strategy.train_step(local, batch.n_tokens)
        state = strategy.memory_report()
        mine = {"peak": meter.peak, "state": state["param_bytes"] + state["grad_bytes"] + state["optimizer_bytes"],
                "pp": ctx.coords["pp"], "routing": routing.steps[-1]}
        strategy.close()
        reports = world.gather_object(mine, 0, tag="tooling/test")
        if env.rank == 0:
            formula = activation_formula(plan, reports)
            shape = ModelShape(gpt=plan.model)
            zero = zero_stage(plan.strategy, plan)
            state_formula = []  # the planner's, for what it plans (not PyTorch's FSDP2, sharded its own way)
            for r in reports:
                s = model_state_bytes(shape, plan.layout, zero, "fp32", r["pp"])
                state_formula.append(s["params"] + s["grads"] + s["optimizer"] if "baseline" not in plan.spec.tags
                                     else None)
            ranks = 1 if plan.dims.world_size == 1 else env.world_size
            print(f"{label}\t" + json.dumps({
                "measured": [r["peak"] for r in reports][:ranks], "formula": formula,
                "state": [r["state"] for r in reports][:ranks], "state_formula": state_formula[:ranks]}), flush=True)
        world.barrier(tag="tooling/test")
    if env.rank == 0:
        print("done", flush=True)
    shutdown(base)
    exit_process(0)


if __name__ == "__main__":
    main()
