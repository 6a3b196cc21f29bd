"""Mixture of experts: expert parallelism over the MoE blocks of parallel/core/model.py.

  expert_parallel.py  dispatch and combine over a Communicator: tokens to their experts' ranks and back
  strategy.py         the strategy `ep`: experts sharded over ep ranks, inside dp
  stats.py            where the router sent the tokens, step by step (the RoutingMeter)
  report.py           the summary's `moe` block and routing.png
  rules.py            its refusals (ep inside dp only; experts must divide over ep)
  theory.py           its closed forms: the all-to-all bytes that routing implies, the expert-sharded
                      model state

The MoE MLP itself and its router live in parallel/core/ (model.py, routing.py), next to the dense
MLP it replaces, so that there is one model definition. Derivations: docs/theory/experts.md.
"""

from __future__ import annotations

from parallel.moe import theory
from parallel.moe.rules import check_ep_layout, check_ep_model
from parallel.spec import StrategySpec


def _build_ep(model, plan, ctx):
    from parallel.moe.strategy import ExpertParallel

    return ExpertParallel(model, ctx.comm("dp"), ctx.comm("ep"), ctx.comm("edp"), plan.grad_sync, plan.bucket_mb,
                          plan.lr, plan.weight_decay)


ENTRIES = (
    StrategySpec(
        name="ep", description="expert parallelism: each MoE block's experts sharded over ep ranks, tokens carried by "
                               "all-to-all; inside dp (dense gradients over dp, experts' over edp)",
        build=_build_ep, comm=theory.ep_comm, model_state=theory.ep_model_state_bytes,
        local_parameters=theory.ep_local_parameter_count, dims=frozenset({"dp", "ep"}), min_world=2, grad_sync=True,
        check=check_ep_layout, check_model=check_ep_model, moe=True,
    ),
)
