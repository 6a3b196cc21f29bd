"""Local SGD, DiLoCo and Streaming DiLoCo: workers that sync every H steps, not every step.

  options.py    its options: parallel.inner_steps (H), outer_lr, outer_momentum, fragments (F)
  schedule.py   which parameters make each fragment, which fragments sync after which step
  strategy.py   the strategy `diloco`: H inner steps, then the outer all-reduce and Nesterov step
  rules.py      its refusals that need the model (fragments against parts and H)
  theory.py     its closed forms: bytes per fragment sync, the mean per step, the outer state

With H = 1, outer_lr = 1, outer_momentum = 0 and train.optimizer=sgd it is dp, step for step.
PyTorch has no counterpart here (torchft ships DiLoCo, but is not installed): `counterpart` None.
Derivations and how to run: docs/diloco.md.
"""

from __future__ import annotations

from parallel import algebra
from parallel.activations import registry_activations
from parallel.diloco import theory
from parallel.diloco.options import DiLoCoOptions
from parallel.diloco.rules import diloco_rules
from parallel.family import Family, Search
from parallel.spec import StrategySpec


def _build_diloco(model, plan, ctx):
    from parallel.diloco.strategy import DiLoCo
    from parallel.strategy import plan_optimizer

    return DiLoCo(model, plan_optimizer(model, plan), ctx.comm("dp"), plan.layout.of(DiLoCoOptions))


def _describe(layout, spec) -> dict:
    if not spec.uses(DiLoCoOptions):
        return {}
    options = layout.of(DiLoCoOptions)
    return {"inner_steps": options.inner_steps, "outer_lr": options.outer_lr,
            "outer_momentum": options.outer_momentum, "fragments": options.fragments}


def _label(described: dict) -> list[str]:
    if "inner_steps" not in described:
        return []
    return [f"H{described['inner_steps']}"] + ([f"F{described['fragments']}"] if described["fragments"] > 1 else [])


def _search(search: Search) -> list[DiLoCoOptions]:
    """The planner's records (conf/plan.yaml's plan.search): each H in `inner_steps` with each F in
    `fragments` that fits it, the outer optimizer DiLoCo's (outer_lr, outer_momentum: 0.7 and 0.9)."""
    if not search.spec.uses(DiLoCoOptions):
        return [DiLoCoOptions()]
    space = search.space
    return [DiLoCoOptions(inner_steps=h, outer_lr=space.get("outer_lr", 0.7), outer_momentum=space.get(
        "outer_momentum", 0.9), fragments=f) for h in space.get("inner_steps", (10, 50))
            for f in space.get("fragments", (1,)) if f <= h]


FAMILY = Family("diloco", DiLoCoOptions, rules=diloco_rules, search=_search, describe=_describe, label=_label)

ENTRIES = (
    StrategySpec(
        name="diloco", description="DiLoCo / local SGD: H local steps per worker, then an all-reduce of the "
                                   "pseudo-gradient and an outer Nesterov step (streaming: F fragments in turn)",
        build=_build_diloco, comm=theory.diloco_comm, model_state=theory.diloco_model_state_bytes,
        local_parameters=algebra.tp_local_parameter_count, activations=registry_activations, min_world=2,
        honours={"diloco": ("inner_steps", "outer_lr", "outer_momentum", "fragments")}, checkpoints=False, sgd=True,
        moe_refusal="its fragments are cut from a dense model's parts, and no test covers experts",
        tied_head_refusal="its fragments hold each parameter once, and a tied table belongs to two parts",
    ),
)
