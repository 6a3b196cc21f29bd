"""ZeRO (Rajbhandari et al. 2019), stages 1, 2 and 3, written by hand on the communication log.

  strategy.py   the strategies `zero1`, `zero2`: the model and a ZeroOptimizer over the dp group
                (parallel/sync/zero.py: stages 1 and 2 as a gradient sync + optimizer over any
                group, built from the flat padded parts of parallel/sync/shards.py, which other
                families plug in too)
  zero3.py      the strategy `zero3`
  rules.py      its refusals (where parallel.zero means nothing, where ZeRO-3 cannot run)
  theory.py     its closed forms: the bytes of each stage, the sharded model state
  hsdp.py       the strategies `hsdp` and `hsdp_zero2` (hybrid sharding: ZeRO-3 or ZeRO-2 inside groups of
                parallel.dp_shard ranks, the gradient shards all-reduced across the groups; docs/hsdp.md)
  hsdp_theory.py  their closed forms, per group (dp_shard, dp_replicate)

The entries `zero1`, `zero2`, `zero3`, `hsdp_zero2` and `hsdp` are at the end of this file.

Plain data parallelism keeps on every rank the whole model, all its gradients and all the
optimizer state (fp32 Adam: 4 + 4 + 8 bytes per parameter). ZeRO keeps the same computation but
lets each of the N data-parallel ranks *own* 1/N of every tensor of model state:

* stage 1 (`zero1`): each rank keeps the optimizer state of its shard only. After backward (once
  per optimizer step, after accumulating all microbatches locally) the gradients are
  reduce-scattered, so each rank holds the summed gradient of its shard; it steps its shard; the
  updated shards are all-gathered so every rank has the whole model again.
* stage 2 (`zero2`): gradients are sharded as well. As backward finishes the gradients of one
  model part, the part is reduce-scattered at once (asynchronously, while backward goes on with
  earlier parts; one in flight at a time) and the part's full gradients are freed; each rank
  keeps only its shard of the summed gradient. With several microbatches every microbatch's
  backward reduce-scatters and the results add up in the shard, as DeepSpeed's stage 2 does: no
  full gradient outlives its part's backward, at the price of one reduce-scatter per microbatch.
* stage 3 (`zero3`): parameters are sharded too. A part's parameters exist in full only while it
  computes: all-gathered just before its forward, freed after it; all-gathered again just before
  its backward, freed (with its full gradients) once its gradients are reduce-scattered.

The unit of sharding is a *part* of the model, the pieces model.py is made of: the embedding, each
Block, the head (`part_of` in parallel/core/model.py names a parameter's part). Each part's
parameters live in one flat fp32 buffer, padded with zeros to a multiple of N so it splits into N equal shards; rank r
owns elements [r·S, (r+1)·S) of every part, S = padded / N. Padding is why the bytes moved and held
are computed on Ψ_pad = Σ_parts ceil(Ψ_part / N)·N (algebra.zero_padded_parameter_count).

The optimizer sees only its shard: parallel/core/optim.py's AdamW over the pieces of the shard, one
piece per parameter the shard overlaps (and one for the padding), each piece in the weight-decay
group of its parameter (no decay on biases and LayerNorm weights, as strategy.make_optimizer).
AdamW is elementwise, so stepping the pieces does per element the same arithmetic as stepping the
whole parameters.

`parallel.comm_dtype` (bf16, int8, fp8; parallel/sync/lowprec.py) carries every stage's gradient
reduce-scatters, and zero3's weight all-gathers, in that format; ZeRO-1 and 2 gather their updated
weights in fp32 (docs/low-precision-collectives.md).
"""

from __future__ import annotations

from dataclasses import replace

from parallel import algebra
from parallel.activations import registry_activations
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions
from parallel.zero import hsdp_theory, theory
from parallel.zero.rules import ZERO3_NO_TIED_HEAD, check_hsdp


def _build_zero(stage):
    def build(model, plan, ctx):
        from parallel.zero.strategy import ZeroDataParallel

        return ZeroDataParallel(model, ctx.comm("dp"), stage, plan.lr, plan.weight_decay,
                                plan.layout.of(SyncOptions).comm_dtype)
    return build


def _build_zero3(model, plan, ctx):
    from parallel.zero.zero3 import Zero3

    return Zero3(model, ctx.comm("dp"), plan.lr, plan.weight_decay, plan.layout.of(SyncOptions).comm_dtype)


def _entry(stage: int, what: str, build) -> StrategySpec:
    return StrategySpec(
        name=f"zero{stage}", description=f"ZeRO stage {stage}: {what} sharded over dp",
        build=build, comm=lambda model, layout: theory.zero_comm(model, layout, stage),
        model_state=lambda model, layout: theory.zero_model_state_bytes(model, layout, stage),
        local_parameters=algebra.tp_local_parameter_count, min_world=2, tags=frozenset({"sharded"}),
        honours={"sync": ("comm_dtype",)},
        counterpart=f"torch_zero{stage}" if stage < 3 else "torch_fsdp2", moe=True,
        # Every stage has the activation formula (zero3 too: tests/helpers/planner_memory_check.py measures
        # it). Recomputation is the project's transform of whole blocks: ZeRO-1/2 run the model's
        # forward as dp does and take it; zero3's hooks gather each part's parameters around one
        # forward per backward, and it does not.
        activations=registry_activations, recompute=stage < 3,
        # ZeRO-1/2 keep whole parameters in the model: the shared table is one parameter of the embedding's part.
        tied_head=stage < 3, tied_head_refusal=ZERO3_NO_TIED_HEAD if stage == 3 else "",
    )


def _build_hsdp(stage):
    def build(model, plan, ctx):
        from parallel.zero.hsdp import HSDP, HSDPZero2

        return (HSDP if stage == 3 else HSDPZero2)(model, ctx.comm("dp"), ctx.comm("dp_shard"),
                                                   ctx.comm("dp_replicate"), plan.lr, plan.weight_decay)
    return build


def _hsdp_entry(stage: int) -> StrategySpec:
    return replace(  # zero3's or zero2's entry (activations, recomputation, tied head, MoE), on two groups
        _entry(stage, "", _build_zero3 if stage == 3 else _build_zero(stage)),
        name="hsdp" if stage == 3 else "hsdp_zero2",
        description=f"HSDP: ZeRO-{stage} over parallel.dp_shard ranks, gradient shards all-reduced across the "
                    "dp / dp_shard groups (docs/hsdp.md)",
        build=_build_hsdp(stage), comm=lambda model, layout: hsdp_theory.hsdp_comm(model, layout, stage),
        model_state=lambda model, layout: hsdp_theory.hsdp_model_state_bytes(model, layout, stage),
        dims=frozenset({"dp", "dp_shard"}), min_world=4, check=check_hsdp,
        honours={},  # its collectives run in fp32: parallel.comm_dtype is refused (the zero entries honour it)
        counterpart="torch_hsdp" if stage == 3 else None,
    )


ENTRIES = (
    _entry(1, "optimizer state", _build_zero(1)),
    _entry(2, "optimizer state and gradients", _build_zero(2)),
    _entry(3, "optimizer state, gradients and parameters", _build_zero3),
    _hsdp_entry(2),
    _hsdp_entry(3),
)
