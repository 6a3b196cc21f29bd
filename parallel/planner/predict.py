"""One candidate layout -> one row of the plan: memory per device, bytes per link class, step time.

The row's names are the contract tools read (plan.json):

    layout                  preset (the conf/parallel preset that runs it, or null), strategy, dp, tp,
                            pp, cp, ep, microbatches, microbatch_size, each family's options as the summary
                            describes them (parallel/family.py), zero and grad_sync as they run (and recompute
                            where it exists)
    memory_bytes_per_device params, grads, optimizer, activations, buffers, total: the rank that holds
                            the most (a pipeline's stages differ); null parts where no formula covers it
    fits                    total <= the device's usable bytes (capacity - runtime, less the headroom)
    over_bytes              how far past the usable bytes it is (negative: room left)
    bytes_per_step          intra_node, inter_node: all ranks' bytes per optimizer step (the closed forms)
    step_time_s             compute, exposed_comm, bubble, total; codec (the part of compute that is the
                            lossy collectives' and DiLoCo's elementwise work, codec.py); optimizer (the part
                            that is the optimizer step, optimizer_step.py)
    tokens_per_s, mfu       global tokens per step / total; model FLOPs per second / peak (a fraction)
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from parallel.core.shape import ModelShape
from parallel.dist.dims import SIZES
from parallel.planner import memory, moe
from parallel.planner.cluster import Cluster
from parallel.planner.codec import codec_seconds
from parallel.planner.enumerate import Candidate
from parallel.planner.optimizer_step import elements_stepped, optimizer_seconds
from parallel.planner.remedies import outer_state_per_parameter, trade_notes, zero_shards
from parallel.planner.shard_copies import copy_seconds
from parallel.planner.timing import step_time
from parallel.planner.traffic import NoTrafficFormula, bytes_by_link, layout_traffic
from parallel.registry import describe
from parallel.sync.options import SyncOptions

ACT_BYTES = {"fp32": 4, "bf16": 2}


def activation_bytes(shape: ModelShape, candidate: Candidate, precision: str,
                     flash_attention: bool = True) -> list[int] | None:
    """Saved bytes per rank: the registry's formula in fp32 with a fused attention core, for GPT-2's
    block and Llama's alike (what every run is checked against: the CPU's kernel saves no s x s
    scores), else parallel/planner/memory.py's for this shape, precision and attention kernel (the
    cluster's `flash_attention`), where the strategy has a formula at all."""
    plan, layout = candidate.plan, candidate.layout
    if shape.gpt.moe_experts and precision == "fp32" and flash_attention:
        return moe.sandbox_activation_bytes(shape, layout)  # the sandbox's MoE blocks, uniform routing
    if precision == "fp32" and flash_attention:
        return plan.spec.activations(shape.gpt, layout)
    if not implementation_figure(plan.spec, shape, layout, precision, flash_attention):
        return None
    # Elsewhere (bf16, materialized attention): as a Megatron-style implementation holds
    # them (memory.py), the same for every ZeRO stage (the search asks for each).
    any_stage = replace(layout, options=layout.options.with_record(replace(layout.of(SyncOptions), zero=0)))
    return _cached(("acts", shape, _layout_key(any_stage), precision, flash_attention),
                   lambda: memory.implementation_activation_bytes(shape, layout, ACT_BYTES[precision],
                                                                  flash_attention))


def implementation_figure(spec, shape: ModelShape, layout, precision: str, flash_attention: bool) -> bool:
    """Whether a row's saved bytes are memory.py's `implementation_activation_bytes` (bf16 or materialized
    attention), as `activation_bytes` decides: not where the strategy has no activation formula at all,
    nor under the all-to-all kind of context parallelism (its inner core holds gathered heads: the
    registry's formula, in fp32 only). Ring context parallelism saves per token what one rank without it
    does, for its s/cp tokens (parallel/activations.py's `block_terms`, measured in fp32)."""
    if precision == "fp32" and flash_attention:
        return False
    if layout.dims.cp > 1 and layout.cut().cp_kind != "ring":
        return False
    # Whether the strategy has a formula at all is asked of its layout without cp, which the registry's
    # formulas cover on one stage only.
    dims = layout.dims
    flat = replace(layout, dims=replace(dims, dp=dims.dp * dims.cp, cp=1)) if dims.cp > 1 else layout
    return bool(shape.gpt.moe_experts) or _has_formula(spec, shape, flat)


_CACHE: dict = {}


def _cached(key, compute):
    """The search asks for the same stage of the same layout shape for many rows (every microbatch count,
    ZeRO stage and option): each figure is computed once. Cleared when it grows past a bound."""
    if key not in _CACHE:
        if len(_CACHE) > 200_000:
            _CACHE.clear()
        _CACHE[key] = compute()
    return _CACHE[key]


def _layout_key(layout) -> str:
    return repr(layout)


def _placement_key(layout) -> tuple:
    """What a stage's placement reads: the dimensions and the families' options, not the microbatches."""
    return layout.dims, layout.options


def _stage_state(shape: ModelShape, layout, zero: int, precision: str, r: int, outer: int = 0) -> dict:
    """memory.model_state_bytes, which reads the stage's placement, not m."""
    key = ("state", shape, _placement_key(layout), zero, precision, r, outer)
    return _cached(key, lambda: memory.model_state_bytes(shape, layout, zero, precision, r, outer))


def _stage_buffers(shape: ModelShape, layout, zero: int, precision: str, r: int) -> int:
    """memory.buffer_bytes, which reads the placement and the microbatch size, not m."""
    key = ("buffers", shape, _placement_key(layout), zero, precision, r, layout.microbatch_size)
    return _cached(key, lambda: memory.buffer_bytes(shape, layout, zero, precision, r))


_FORMULA: dict[tuple, bool] = {}


def _has_formula(spec, shape: ModelShape, layout) -> bool:
    """Whether the strategy's registry formula covers this layout at all (recompute aside), asked once
    per strategy, model, dims and precision: what the formulas' coverage reads (activations.covers),
    not the schedule, the microbatches or the options, which the search varies most."""
    key = (spec.name, shape.gpt, layout.dims, layout.precision, layout.cut().cp_kind)
    if key not in _FORMULA:
        _FORMULA[key] = spec.activations(shape.gpt, replace(layout, recompute="none")) is not None
    return _FORMULA[key]


def moe_model_state(shape: ModelShape, candidate: Candidate, precision: str) -> dict | None:
    """A mixture of experts' model state per rank: the registry's formula (ep: E/ep experts per
    rank; dp, ZeRO: theory's count of every expert), the figure every run's memory is checked
    against, for the sandbox GPT in fp32 and one stage (MoE runs no pipeline); else None (memory.py's,
    which holds E/ep experts per MoE block too)."""
    plan = candidate.plan
    if precision != "fp32" or candidate.layout.dims.pp != 1:
        return None
    figures = plan.spec.model_state(shape.gpt, candidate.layout)
    if figures is None:
        return None
    return {"params": figures["param_bytes"], "grads": figures["grad_bytes"], "optimizer": figures["optimizer_bytes"],
            "parameters_counted": figures["parameters_counted"]}


def predict_row(shape: ModelShape, candidate: Candidate, cluster: Cluster, preset: str | None,
                time_if_over: bool = True) -> dict:
    """The row of one candidate. `time_if_over=False` (the search): a layout whose memory is over the
    device gets no bytes and no step time (its rank among the misses is by memory alone), a note says so."""
    plan, layout = candidate.plan, candidate.layout
    dims, precision = layout.dims, cluster.precision
    if precision == "bf16":
        from dataclasses import replace

        layout = replace(layout, dtype_bytes=2)  # gradients and activations cross ranks in bf16
    row_layout = {
        "preset": preset, "strategy": plan.strategy, **{d: getattr(dims, d) for d in SIZES},
        "microbatches": layout.microbatches, "microbatch_size": layout.microbatch_size,
        # Each family's options, null where the strategy does not honour them; the ZeRO stage and the
        # all-reduce sync as they run (a zero<k> strategy's stage is in its name).
        **describe(layout, plan.spec), "zero": candidate.zero, "grad_sync": candidate.grad_sync,
        **({"recompute": candidate.request["recompute"]} if "recompute" in candidate.request else {}),
    }
    notes = trade_notes(plan.spec, layout)
    layers = memory.rank_layers(shape, layout)
    activations = activation_bytes(shape, candidate, precision, cluster.flash_attention)
    if activations is None:
        notes.append(f"no activation formula for {plan.strategy} on this layout")
    per_stage = [_stage_memory(shape, candidate, layout, precision, r, activations) for r in range(dims.pp)]
    worst, fits = _worst_stage(per_stage, cluster.usable_bytes)
    if fits is False and not time_if_over:
        notes.append("not timed: its memory is over the device")
        traffic, links, time = None, None, None
    else:
        traffic, links, time = _traffic_and_time(shape, candidate, cluster, layout, layers, notes)
    if shape.gpt.moe_experts:
        notes.append(f"mixture of experts: uniform routing, nothing dropped, the busiest ep rank's expert rows "
                     f"{moe.IMBALANCE} x the mean (assumed); all-to-all bytes theory's uniform figure")
    tokens = plan.global_batch * shape.gpt.seq_len
    total = time.total if time else None
    return {
        "layout": row_layout,
        "memory_bytes_per_device": worst,
        "memory_by_stage": per_stage,  # pp rank r: every rank of stage r holds the same
        "fits": fits,
        "over_bytes": worst["total"] - cluster.usable_bytes if worst["total"] is not None else None,
        "bytes_per_step": {"intra_node": links["intra_node"], "inter_node": links["inter_node"]} if links else None,
        "bytes_exact": str(sum((t.total for t in traffic.values()), Fraction(0))) if traffic else None,
        "bytes_by_group": {g: float(t.total) for g, t in traffic.items()} if traffic else None,
        "step_time_s": {"compute": time.compute, "exposed_comm": time.exposed_comm, "bubble": time.bubble,
                        "total": total, "codec": time.codec, "optimizer": time.optimizer,
                        "copies": time.copies} if time else None,
        "comm_seconds_by_group": time.comm_by_group if time else None,
        "tokens_per_s": tokens / total if total else None,
        "mfu": shape.flops_per_token() * tokens / total / cluster.peak_for_mfu(dims.world_size) if total else None,
        "hfu": time.hardware_flops / total / cluster.peak_for_mfu(dims.world_size)
        if total and time.hardware_flops else None,
        "compute_s": time.compute_parts if time else None,
        "notes": notes,
    }


def _stage_memory(shape: ModelShape, candidate: Candidate, layout, precision: str, r: int,
                  activations: list[int] | None) -> dict:
    """The memory parts of one rank of stage r (every rank of a stage holds the same), and their total
    where every part has a formula."""
    outer = outer_state_per_parameter(candidate.plan.spec, layout)
    state = (moe_model_state(shape, candidate, precision) if shape.gpt.moe_experts else None) \
        or _stage_state(shape, layout, candidate.zero, precision, r, outer)
    acts = activations[layout.dims.rank_of(r, 0, 0)] if activations is not None else None
    buffers = _stage_buffers(shape, layout, candidate.zero, precision, r)
    parts = {"params": state and state["params"], "grads": state and state["grads"],
             "optimizer": state and state["optimizer"], "activations": acts, "buffers": buffers}
    parts["total"] = sum(parts.values()) if all(v is not None for v in parts.values()) else None
    return parts


def _worst_stage(per_stage: list[dict], usable_bytes: float) -> tuple[dict, bool | None]:
    """The stage that holds the most, and whether it fits. A part without a formula leaves the total
    unknown, but what is known is a lower bound: model state alone beyond the usable memory does not
    fit, whatever the activations."""
    worst = max(per_stage, key=lambda m: -1 if m["total"] is None else m["total"])
    if worst["total"] is not None:
        return worst, worst["total"] <= usable_bytes
    known = max(sum(v for k, v in m.items() if k != "total" and v is not None) for m in per_stage)
    if known <= usable_bytes:
        return worst, None
    worst = max(per_stage, key=lambda m: sum(v for k, v in m.items() if k != "total" and v is not None))
    return {**worst, "total": known}, False


def _optimizer_seconds(shape: ModelShape, candidate: Candidate, cluster: Cluster, layout) -> float:
    """The optimizer step of the stage whose optimizer updates the most elements (optimizer_step.py)."""
    shards = zero_shards(layout.dims)
    elements = max(elements_stepped(memory.stage_parts(shape, layout, r), candidate.zero, shards)
                   for r in range(layout.dims.pp))
    return optimizer_seconds(elements, candidate.plan.optimizer, cluster.precision, cluster.codec_bytes_per_s)


def _copy_seconds(shape: ModelShape, candidate: Candidate, cluster: Cluster, layout) -> float:
    """The sharded strategies' copies around their collectives on the stage with the most (shard_copies.py)."""
    spec = candidate.plan.spec
    return max(copy_seconds(spec.tags, candidate.zero, zero_shards(layout.dims), layout.microbatches,
                            memory.stage_parts(shape, layout, r), cluster.codec_bytes_per_s)
               for r in range(layout.dims.pp))


def _traffic_and_time(shape: ModelShape, candidate: Candidate, cluster: Cluster, layout, layers: list[int],
                      notes: list[str]):
    """Bytes per group (theory's closed forms) and the step time (timing.py) of the row."""
    plan = candidate.plan
    try:
        traffic = layout_traffic(plan.spec, shape, layout, candidate.zero, cluster.gpus_per_node, cluster.algorithm,
                                 layers)
        links = bytes_by_link(traffic)
        codec = codec_seconds(shape, plan.spec, layout, candidate.zero, cluster)
        time = step_time(shape, layout, candidate.zero, candidate.grad_sync, cluster, traffic, layers,
                         ACT_BYTES[cluster.precision], codec, _optimizer_seconds(shape, candidate, cluster, layout),
                         _copy_seconds(shape, candidate, cluster, layout))
    except NoTrafficFormula as e:
        notes.append(f"no traffic formula: {e}")
        traffic, links, time = None, None, None
    return traffic, links, time
