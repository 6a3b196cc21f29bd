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

from parallel.family import Family
from parallel.moe import theory
from parallel.moe.report import routing_block, with_measured_routing
from parallel.moe.rules import check_ep_layout, check_ep_model
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions


def _build_ep(model, plan, ctx):
    from parallel.moe.strategy import ExpertParallel

    sync = plan.layout.of(SyncOptions)
    return ExpertParallel(model, ctx.comm("dp"), ctx.comm("ep"), ctx.comm("edp"), sync.grad_sync, sync.bucket_mb,
                          plan.lr, plan.weight_decay)


ENTRIES = (
    StrategySpec(
        name="ep", description="expert parallelism: each MoE block's experts sharded over ep ranks, tokens carried by "
                               "all-to-all; inside dp (dense gradients over dp, experts' over edp)",
        build=_build_ep, comm=theory.ep_comm, model_state=theory.ep_model_state_bytes,
        local_parameters=theory.ep_local_parameter_count, dims=frozenset({"dp", "ep"}), min_world=2,
        honours={"sync": ("grad_sync", "bucket_mb")},
        check=check_ep_layout, check_model=check_ep_model, moe=True, tied_head=True,
    ),
)


def _report(plan, rank_reports: list[dict], run_dir) -> dict:
    return {"moe": routing_block(plan, rank_reports, run_dir)} if plan.model.moe_experts else {}


# No options of its own (the experts are the model's, ep a dimension): what it adds to a run's summary.
FAMILY = Family("moe", None, report=_report, measured=with_measured_routing)
