"""Composition: the families on one mesh, and the one table of what runs.

  combined.py     the recipe: any dp x cp x tp x pp layout, pipeline stages of tensor-parallel
                  blocks with context-parallel attention, dp or ZeRO-1/2 on top
  cp_pipeline.py  context parallelism in front of a pipeline (where the cp and pp families meet)
  route.py        the table from a requested strategy, the layout and the ZeRO stage to the entry
                  that runs it (`resolve`)
  theory.py       the recipe's closed forms: every dimension's bytes together, the model state per stage

The entries here are the recipe's: `3d`, and `pp`, which is the recipe with tp = cp = 1 (the pp
family holds the schedules and the runner, not a strategy of its own).
"""

from __future__ import annotations

from parallel.compose import theory
from parallel.pp import theory as pp_theory
from parallel.pp.rules import PP_NO_MOE, PP_NO_TIED_HEAD
from parallel.spec import StrategySpec
from parallel.tp.rules import TP_NO_MOE


def _build_combined(model, plan, ctx):
    from parallel.compose.combined import build_combined

    return build_combined(model, plan, ctx)


PIPELINE = ("schedule", "virtual_stages", "layers", "posting")  # posting: the executor's own (parallel/pp/posting.py)
SYNC = ("grad_sync", "bucket_mb", "zero")  # each stage's dp sync: all-reduce or ZeRO-1/2

ENTRIES = (
    StrategySpec(
        name="pp",
        description="pipeline parallel: GPipe, 1F1B, interleaved, ZB-H1, ZB-V or DualPipeV, schedules as data",
        build=_build_combined, comm=pp_theory.pipeline_comm, dims=frozenset({"dp", "pp"}),
        honours={"pp": PIPELINE, "sync": SYNC}, counterpart="torch_pp", moe_refusal=PP_NO_MOE, recompute=True,
        activations=pp_theory.pipeline_activations, tied_head_refusal=PP_NO_TIED_HEAD,
    ),
    StrategySpec(
        name="3d", description="dp x cp x tp x pp on one mesh: tensor-parallel pipeline stages, context-parallel "
        "attention, dp or ZeRO-1/2 on top",
        build=_build_combined, comm=theory.combined_comm, model_state=theory.combined_first_stage_model_state_bytes,
        local_parameters=theory.combined_first_stage_parameter_count, dims=frozenset({"dp", "cp", "tp", "pp"}),
        # the same parallelize_tp cuts its stages, saved sequence pieces included
        honours={"tp": ("sequence_parallel", "saves"), "pp": PIPELINE, "cp": (), "sync": SYNC}, recompute=True,
        moe_refusal=f"{TP_NO_MOE}, and {PP_NO_MOE}", activations=pp_theory.pipeline_activations,
        tied_head_refusal=f"the recipe's pipeline stages hold one part each: {PP_NO_TIED_HEAD}",
    ),
)
