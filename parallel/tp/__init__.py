"""Tensor parallelism (Megatron): each layer's weights cut over tp ranks, activations summed inside.

  regions.py    the four conjugate regions (copy / all-reduce, and under sequence parallelism
                all-gather / reduce-scatter) that wrap the cut layers, and the column-parallel
                linear that keeps its input's sequence piece (parallel.tp_saves=sharded)
  layers.py     the column- and row-parallel linears, the vocab-parallel embedding, `parallelize_tp`
  loss.py       the vocab-parallel cross-entropy on the sharded logits
  strategy.py   the strategy `tp` (dp x tp), with or without sequence parallelism
  rules.py      its refusals (parallel.tp_saves among them, and why it refuses a mixture of experts)
  theory.py     its closed forms: the tp collectives per layer and microbatch, with and without SP

With pipeline stages or context parallelism too, a `tp` request runs as the recipe `3d`
(parallel/compose/route.py). Derivations: docs/theory/tensor-parallel.md.
"""

from __future__ import annotations

from parallel import algebra
from parallel.activations import registry_activations
from parallel.spec import StrategySpec
from parallel.tp import theory
from parallel.tp.rules import TP_NO_MOE


def _build_tp(model, plan, ctx):
    from parallel.strategy import make_optimizer
    from parallel.tp.strategy import TensorParallel

    return TensorParallel(model, lambda module: make_optimizer(module, plan.lr, plan.weight_decay), ctx.comm("tp"),
                          ctx.comm("dp"), plan.sequence_parallel, plan.grad_sync, plan.bucket_mb,
                          saves_shard=plan.tp_saves == "sharded")


ENTRIES = (
    StrategySpec(
        name="tp", description="tensor parallel (Megatron), optionally with sequence parallelism; dp across tp groups",
        build=_build_tp, comm=theory.tp_comm, local_parameters=algebra.tp_local_parameter_count,
        dims=frozenset({"dp", "tp"}), tensor_parallel=True, sequence_parallel=True, grad_sync=True, zero_dp=True,
        counterpart="torch_tp", moe_refusal=TP_NO_MOE, recompute=True, activations=registry_activations,
        tp_saves=True,
    ),
)
