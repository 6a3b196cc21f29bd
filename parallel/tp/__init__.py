"""Tensor parallelism (Megatron): each layer's weights cut over tp ranks, activations summed inside.

  regions.py    the four conjugate regions (copy / all-reduce, and under sequence parallelism
                all-gather / reduce-scatter) that wrap the cut layers, and the column-parallel
                linear that keeps its input's sequence piece (parallel.tp_saves=sharded)
  layers.py     the column- and row-parallel linears, the norms that open the regions, the
                vocab-parallel embedding, `parallelize_tp` (K/V cut by kv heads, or each kv head
                held by tp/kv ranks where tp exceeds them)
  shards.py     what was cut how (`TPShards`: pieces to wholes and back, the shared kv heads), and
                the once-per-step sums over tp that complete partial gradients
  loss.py       the vocab-parallel cross-entropy on the sharded logits
  strategy.py   the strategy `tp` (dp x tp), with or without sequence parallelism
  options.py    its options: sequence parallelism, and what a column-parallel linear saves
  rules.py      its refusals (the saved piece among them, and why it refuses a mixture of experts)
  search.py     the options the planner tries on a layout
  theory.py     its closed forms: the tp collectives per layer and microbatch, with and without SP

With pipeline stages or context parallelism too, a `tp` request runs as the recipe `3d`
(parallel/compose/route.py). Derivations: docs/theory/tensor-parallel.md.
"""

from __future__ import annotations

from parallel import algebra
from parallel.activations import registry_activations
from parallel.family import Family
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions
from parallel.tp import theory
from parallel.tp.options import TPOptions
from parallel.tp.rules import TP_NO_MOE, tp_rules
from parallel.tp.search import tp_search


def _build_tp(model, plan, ctx):
    from parallel.strategy import plan_optimizer
    from parallel.tp.strategy import TensorParallel

    return TensorParallel(model, lambda module: plan_optimizer(module, plan), ctx.comm("tp"),
                          ctx.comm("dp"), plan.layout.of(TPOptions), plan.layout.of(SyncOptions))


def _describe(layout, spec) -> dict:
    options = layout.of(TPOptions)
    return {"sequence_parallel": options.sequence_parallel,
            "tp_saves": options.saves if options.sequence_parallel else None}


def _label(described: dict) -> list[str]:
    if not described["sequence_parallel"]:
        return []
    return ["sp-sharded" if described["tp_saves"] == "sharded" else "sp"]


FAMILY = Family("tp", TPOptions, rules=tp_rules, search=tp_search, describe=_describe, label=_label)


SYNC_OPTIONS = ("grad_sync", "bucket_mb", "zero")  # the dp sync across tp groups: all-reduce or ZeRO-1/2

ENTRIES = (
    StrategySpec(
        name="tp", description="tensor parallel (Megatron), optionally with sequence parallelism; dp across tp groups",
        build=_build_tp, comm=theory.tp_comm, local_parameters=algebra.tp_local_parameter_count,
        dims=frozenset({"dp", "tp"}), honours={"tp": ("sequence_parallel", "saves"), "sync": SYNC_OPTIONS},
        counterpart="torch_tp", moe_refusal=TP_NO_MOE, recompute=True, tied_head=True, activations=registry_activations,
        sgd=True,
    ),
)
