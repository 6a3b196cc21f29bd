"""What the planner reads of the three remedies for slow links, beside the closed forms that give their bytes.

Their bytes per step come from the registry's closed forms like every strategy's (traffic.py); what
else the planner needs of them is read here, from the entry and its layout:

    hybrid sharding  (hsdp, hsdp_zero2; torch_hsdp): ZeRO over the dp_shard ranks of a shard group, not
                     over dp (the model state, memory.py), at the stage the entry's own model-state
                     formula describes (`sharded_stage`); its groups dp_shard and dp_replicate are
                     placed on nodes as parallel/dist/dims.py numbers them (links.py)
    low precision    (parallel.comm_dtype) a note: the closed forms already count the format's
                     bytes and scales (int8 and fp8 reduce as an all-to-all and an all-gather, which
                     traffic.py counts as a reduction, not as ZeRO's parameter gathers); the casts,
                     the quantization and error feedback are timed by codec.py
    DiLoCo           (parallel=diloco) the sync period H of its outer all-reduce (`period_steps`: its
                     bytes are a mean per step, its time one sync's over H, timing.py) and the outer
                     state each worker keeps (`outer_state_per_parameter`: the outer copy and the
                     Nesterov buffer, in fp32 whatever the training precision)
"""

from __future__ import annotations

from parallel.algebra import replica_group_size
from parallel.core.model import GPTConfig
from parallel.diloco.options import DiLoCoOptions
from parallel.dist.dims import ParallelDims
from parallel.layout import FP32_BYTES, Layout
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions


def period_steps(figure: dict) -> int:
    """Steps per sync of a strategy that syncs once per period (DiLoCo's H: its closed form's
    `period_steps`); 1 for every other, which syncs every step."""
    return int(figure.get("period_steps", 1))


def zero_shards(dims: ParallelDims) -> int:
    """The ranks ZeRO shards the model state over: a shard group's dp_shard ranks under hybrid sharding,
    else every rank that replicates the parameters (dp, or dp·cp)."""
    shard = dims.dp_shard
    return shard if shard > 1 else replica_group_size(dims)


def outer_state_per_parameter(spec: StrategySpec, layout: Layout) -> int:
    """DiLoCo's outer state per parameter of the model: the outer copy and, with momentum, the Nesterov
    buffer, each in fp32 (the outer step runs on the fp32 master weights); 0 for other strategies."""
    if not spec.uses(DiLoCoOptions):
        return 0
    return FP32_BYTES * (2 if layout.of(DiLoCoOptions).outer_momentum > 0 else 1)


def trade_notes(spec: StrategySpec, layout: Layout) -> list[str]:
    """What a row's figures leave out: the remedies that change what is trained cost loss, which no
    formula here predicts (their docs pages measure it)."""
    notes = []
    if spec.uses(DiLoCoOptions):
        h = layout.of(DiLoCoOptions).inner_steps
        notes.append(f"DiLoCo syncs every {h} steps: bytes and time per step are the mean over {h}; its loss "
                     "cost is not modelled (docs/diloco.md)")
    fmt = layout.of(SyncOptions).comm_dtype
    if fmt != "fp32" and spec.honours_option(SyncOptions, "comm_dtype"):
        notes.append(f"gradients reduced in {fmt}: its bytes and scales counted; its loss cost is not modelled "
                     "(docs/low-precision-collectives.md)")
    return notes


_STAGES: dict[tuple, int] = {}


def sharded_stage(spec: StrategySpec, model: GPTConfig, layout: Layout) -> int:
    """The ZeRO stage of an entry that shards over a shard group (HSDP: the stage is in its name, not in
    parallel.zero): the one whose model state over dp_shard ranks its own formula holds; 0 where none.
    Asked once per entry, model and dims (the state reads nothing else)."""
    if layout.dims.dp_shard <= 1:
        return 0
    key = (spec.name, model, layout.dims)
    if key not in _STAGES:
        from parallel.zero.theory import zero_state_over

        held = spec.model_state(model, layout)
        if held is None:  # PyTorch's own (torch_hsdp): the stage of the entry it is the counterpart of
            from parallel.registry import REGISTRY

            ours = next((s for s in REGISTRY.values() if s.counterpart == spec.name), None)
            held = ours.model_state(model, layout) if ours is not None else None
        _STAGES[key] = next((stage for stage in (3, 2, 1)
                             if held == zero_state_over(model, layout, stage, zero_shards(layout.dims))), 0)
    return _STAGES[key]
