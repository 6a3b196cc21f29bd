"""Context parallelism: the sequence split across ranks, attention computed across them.

  layout.py     which tokens rank r holds (2·cp chunks, r and 2·cp − 1 − r), cutting and joining
  blockwise.py  attention of one block of queries on one block of keys, with its log-sum-exp
  ring.py       ring attention: K, V blocks pass around the ring, blocks merged by online softmax
  ulysses.py    all-to-all: sequence-sharded -> head-sharded around an unchanged attention core
  transform.py  the model's embedding and attention cores replaced for one rank
  strategy.py   the strategies cp and cp_a2a (dp x cp)
  theory.py     the bytes each sends, per layer and microbatch, and the model state, as closed forms
  options.py    its option: the kind of attention across the cp ranks, which the entry sets
  rules.py      its refusals (sequence, heads, a mixture of experts), checked before any process group

With tensor or pipeline parallelism too, a cp request runs as the recipe `3d` (the cp kind
travels in the options: parallel/compose/route.py). Derivations and sources: docs/theory/context.md.
"""

from __future__ import annotations

from parallel import algebra
from parallel.activations import registry_activations
from parallel.cp import theory
from parallel.cp.options import CPOptions
from parallel.cp.rules import cp_rules
from parallel.family import Family
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions


def _build_cp(model, plan, ctx):
    from parallel.cp.strategy import ContextParallel

    sync = plan.layout.of(SyncOptions)
    return ContextParallel(model, ctx.comm("cp"), ctx.comm("dp_cp"), plan.layout.of(CPOptions).kind,
                           grad_sync=sync.grad_sync, bucket_mb=sync.bucket_mb, zero=sync.zero, lr=plan.lr,
                           weight_decay=plan.weight_decay)


def _describe(layout, spec) -> dict:
    return {"cp_kind": layout.of(CPOptions).kind if layout.dims.cp > 1 else None}


FAMILY = Family("cp", CPOptions, rules=cp_rules, describe=_describe)


def _entry(name: str, kind: str, what: str) -> StrategySpec:
    return StrategySpec(
        name=name, description=f"context parallel, {what}; gradients summed over dp x cp",
        build=_build_cp, comm=theory.cp_comm, model_state=theory.cp_model_state_bytes,
        local_parameters=algebra.tp_local_parameter_count,
        activations=registry_activations, dims=frozenset({"dp", "cp"}), min_world=2,
        honours={"cp": (), "sync": ("grad_sync", "bucket_mb", "zero")}, sets={"cp": {"kind": kind}}, recompute=True,
        tied_head=True,
    )


ENTRIES = (
    _entry("cp", "ring", "ring attention: K, V blocks passed around the cp ring"),
    _entry("cp_a2a", "a2a", "all-to-all (Ulysses): tokens traded for heads around attention"),
)
