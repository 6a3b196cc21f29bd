"""Pipeline parallelism's closed forms: the p2p traffic per step, from the schedule's placement alone
(each schedule's bubble is in its record, parallel/pp/schedules.py).

Each microbatch crosses every boundary between consecutive virtual stages once forward (its
activation, b·s·h values) and once backward (the gradient of that activation, the same size)
(Narayanan et al. 2021 §3.2). A boundary inside one rank sends nothing. The order of the actions
does not change the bytes, only who sends them to whom, which the placement says:

    loop placement (gpipe, 1f1b, interleaved_1f1b, zbh1):  v·p - 1 crossings (p > 1)
    V placement (zbv, dualpipev):                          2(p - 1) crossings: the turn from
                                                           stage p-1 to p stays on rank p-1

    bytes per step = 2 · m · crossings · b·s·h·B      (B bytes per value)

In the V, rank r sends down the first arm to r+1 and up the second arm to r-1 (both directions,
forward and backward), so ranks 1..p-2 send twice what the ends do; in the loop every rank sends
to r+1 forward and r-1 backward, and with v > 1 the ends also wrap around (p-1 -> 0 and back).

Like every theory file, independent of the code it checks: bytes from the placement and the
shape, not from the executor's sends or the communication log.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from functools import lru_cache

from parallel.activations import registry_activations
from parallel.algebra import FP32_BYTES, all_reduce_sent_per_rank, figure, parameter_count
from parallel.core.model import GPTConfig
from parallel.layout import Layout
from parallel.pp.options import PPOptions
from parallel.pp.schedules import (
    SEND_B,
    SEND_F,
    B,
    F,
    W,
    build_schedule,
    built_schedule,
    closed_form_idle,
    compute_only,
    schedule_placement,
    schedule_splits_backward,
)
from parallel.pp.simulator import simulate
from parallel.pp.split import layer_counts


def boundary_bytes(microbatch_size: int, seq_len: int, d_model: int, dtype_bytes: int) -> int:
    """One microbatch's activation at a stage boundary: b·s·h·B."""
    return microbatch_size * seq_len * d_model * dtype_bytes


def p2p_links(schedule: str, stages: int, microbatches: int, virtual: int, boundary: int) -> dict[tuple[int, int], int]:
    """Bytes each (sender, receiver) pair of pipeline ranks exchanges per step."""
    place = schedule_placement(schedule, stages, virtual)
    links: Counter = Counter()
    for vs in range(place.vstages - 1):
        if place.crosses(vs):
            low, high = place.rank_of(vs), place.rank_of(vs + 1)
            links[low, high] += microbatches * boundary   # the activation, forward
            links[high, low] += microbatches * boundary   # its gradient, backward
    return dict(links)


def p2p_sent_by_rank(schedule: str, stages: int, microbatches: int, virtual: int, boundary: int) -> list[int]:
    """Bytes each pipeline rank sends per step."""
    sent = [0] * stages
    for (src, _), n in p2p_links(schedule, stages, microbatches, virtual, boundary).items():
        sent[src] += n
    return sent


def p2p_bytes_per_step(schedule: str, stages: int, microbatches: int, virtual: int, boundary: int) -> int:
    """2 · m · crossings · boundary bytes for one pipeline."""
    return 2 * microbatches * schedule_placement(schedule, stages, virtual).crossings() * boundary


def pipeline_p2p_bytes(model_cfg: GPTConfig, microbatch_size: int, microbatches: int, stages: int, virtual: int,
                       dtype_bytes: int = FP32_BYTES) -> int:
    """Narayanan §3.2: b·s·h·B per microbatch per stage boundary in each direction, so
    2·m·(v·p-1)·b·s·h·B per step for one pipeline (v = 1 for GPipe and 1F1B)."""
    activation = boundary_bytes(microbatch_size, model_cfg.seq_len, model_cfg.d_model, dtype_bytes)
    return 2 * microbatches * (virtual * stages - 1) * activation


def pipeline_comm(model: GPTConfig, layout: Layout) -> dict:
    """pp and torch_pp (torch's stages send the same activations and gradients): every activation
    and its gradient crosses each boundary between ranks once per microbatch (sends; a receive sends
    nothing), 2·m·crossings·b·s·h·B per pipeline with the schedule's placement's crossings (v·p-1 on
    the loop, 2(p-1) on the V: `p2p_bytes_per_step`), in each of the dp pipelines; with dp > 1
    each stage then all-reduces its own parameters over dp, which sums to 2(dp-1)/dp · Ψ·B per
    pipeline rank position, i.e. 2(dp-1) · Ψ·B over all ranks."""
    dims, B = layout.dims, layout.dtype_bytes
    boundary = boundary_bytes(layout.microbatch_size, model.seq_len, model.d_model, B)
    pipeline = layout.of(PPOptions)
    p2p = dims.dp * p2p_bytes_per_step(pipeline.schedule, dims.pp, layout.microbatches, pipeline.virtual_stages,
                                       boundary)
    totals = {"send": (p2p, Fraction(p2p)), "recv": (p2p, Fraction(0))} if p2p else {}
    if dims.dp > 1:
        grads = parameter_count(model) * B  # summed over the stages of one pipeline
        totals["all_reduce"] = (grads * dims.dp, all_reduce_sent_per_rank(dims.dp, grads) * dims.dp)
    return figure(totals, dims.world_size)


# -- activations: what a rank holds while its schedule runs ---------------------------------------------
def stage_layer_counts(n_layers: int, layout: Layout) -> list[int]:
    """Blocks of each virtual stage (an even split, or the layout's pp_layers)."""
    pipeline = layout.of(PPOptions)
    explicit = list(pipeline.layers) if pipeline.layers is not None else None
    return layer_counts(n_layers, layout.dims.pp * pipeline.virtual_stages, explicit)


@lru_cache(maxsize=1024)
def schedule_walk(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """Each rank's forwards and backwards in the schedule's order, as (op: F, B or W, virtual stage):
    the lists the simulator checks and the executor runs (built once per schedule and shape), each
    chunk named by the schedule's placement (the V's chunk 1 of rank r is virtual stage 2p - 1 - r)."""
    placement = schedule_placement(schedule, p, v)
    return tuple(tuple((a.op, placement.vstage(r, a.chunk)) for a in compute_only(actions))
                 for r, actions in enumerate(build_schedule(schedule, p, m, v)))


def pipeline_walk(layout: Layout) -> tuple[tuple[tuple[bool, int], ...], ...] | None:
    """`schedule_walk` of the layout's schedule, or None without a pipeline."""
    dims = layout.dims
    if dims.pp == 1:
        return None
    pipeline = layout.of(PPOptions)
    return schedule_walk(pipeline.schedule, dims.pp, layout.microbatches, pipeline.virtual_stages)


def pipeline_activations(model: GPTConfig, layout: Layout) -> list[int] | None:
    """The registry's `activations` (parallel/activations.py's `registry_activations`), given the
    layout's virtual stages and, in a pipeline, its schedule's walk."""
    walk = pipeline_walk(layout)
    return registry_activations(model, layout, layers=stage_layer_counts(model.n_layers, layout), walk=walk)


@lru_cache(maxsize=65536)
def schedule_makespan(schedule: str, p: int, m: int, v: int, forward: float, backward: float, send: float,
                      weight_share: float = 0.5) -> float:
    """The simulator's makespan for one step: each rank's forward and backward of a microbatch over
    all its chunks cost `forward` and `backward` (a chunk 1/v of them), a send `send` on its sender.
    Where a schedule splits the backward (zero-bubble schedules), its weight-gradient half W costs
    `weight_share` of the backward and its input-gradient half B the rest: half each by default, the
    two matmuls of a linear layer's backward, of equal size (an assumption the output names); none
    under full recomputation, whose blocks run their whole backward inside B (parallel/core/recompute.py)."""

    split = schedule_splits_backward(schedule, p, m, v)
    weights = backward * weight_share if split else 0.0
    inputs = backward - weights
    if send == 0:
        # The schedule's closed form, where it claims one: every rank works m(F + B + W) and idles for
        # its longest chain (parallel/pp/schedules.py, equal to the simulator's makespan for free sends).
        idle = closed_form_idle(schedule, p, m, v, forward, inputs, weights)
        if idle is not None:
            return m * (forward + backward) + float(idle)

    def cost(action, virtual, split=False):
        if action.op == F:
            return forward / virtual
        if action.op == B:
            return (inputs if split else backward) / virtual
        if action.op == W:
            return weights / virtual
        return send if action.op in (SEND_F, SEND_B) else 0.0

    # On the schedule's own placement: a V-shaped schedule (zbv, dualpipev) puts virtual stage p on rank
    # p - 1, not rank 0, and its lists read as invalid on the loop placement.
    plans = built_schedule(schedule, p, m, v)
    return simulate([list(actions) for actions in plans], m, v, cost, schedule_placement(schedule, p, v)).makespan
