"""Floors under a request's memory, read off the request before run_plan.py is asked about it.

Of the layouts a large search asks run_plan.py about, nearly all can be over the device (a
trillion-parameter model on thousands of devices: most pipelines hold too many microbatches), and
asking is what the search spends its time on: run_plan.py's checks, and the prediction, which walks
every rank's schedule for its activations. Each floor here is one that memory.py's own figure can
only exceed, so a request whose floor is over the device's usable memory cannot fit and is not asked:

model_state_over   the fullest rank holds at least its blocks' parameters over tp and pp (the
                   fullest stage holds at least the mean; the embedding and head left out) at the
                   model state's bytes per parameter (`state_bytes_per_parameter`).
first_rank_over    the rank that holds the most holds at least what the first pipeline rank does
                   (memory.py's figure for stage 0), and that is at least:
  model state      the blocks of its chunks (the split the request gives or the even one, on the
                   schedule's placement) at the same bytes per parameter; its embedding left out;
  activations      at a moment of its peak it holds the schedule's `first_rank_in_flight`
                   microbatches of each chunk (parallel/pp/schedules.py, held to the walk memory.py
                   takes), each at its chunk's bytes as memory.py counts them (`memory.block_saves`);
                   the block being recomputed beside them left out; counted only where a row's saved
                   bytes are memory.py's (`predict.implementation_figure`), 0 elsewhere;
  buffers          left out.

tests/tools/test_planner_memory_floor.py holds every row of a search over its floor.
"""

from __future__ import annotations

from functools import lru_cache

from parallel.core.shape import ModelShape
from parallel.dist.dims import SIZES, LayoutError, ParallelDims
from parallel.layout import Layout
from parallel.model_state import STATE_BYTES
from parallel.planner import memory
from parallel.planner.cluster import Cluster
from parallel.planner.predict import ACT_BYTES, implementation_figure
from parallel.pp.options import PPOptions
from parallel.pp.schedules import first_rank_in_flight, schedule_placement
from parallel.pp.split import SplitError, layer_counts
from parallel.registry import REGISTRY, resolve
from parallel.spec import ConfigError
from parallel.sync.options import SyncOptions


def state_bytes_per_parameter(spec, request: dict, precision: str) -> float:
    """The fewest model-state bytes a parameter of the request can cost a rank: the precision's bytes
    per parameter, ZeRO dividing what its stage shards by at most dp·cp, or dp_shard under hybrid
    sharding (a strategy without parallel.zero counted as sharding everything, ZeRO-3)."""
    param_b, grad_b, optim_b = STATE_BYTES[precision]
    zero = request.get("zero", 0) if spec.honours_option(SyncOptions, "zero") else 3
    shard = request.get("dp_shard", 1)  # hybrid sharding: ZeRO over a shard group only
    d = shard if shard > 1 else request["dp"] * request.get("cp", 1)
    return param_b / (d if zero >= 3 else 1) + grad_b / (d if zero >= 2 else 1) + optim_b / (d if zero >= 1 else 1)


def model_state_over(shape: ModelShape, cluster: Cluster):
    """`beyond(spec, request)`: true where the fullest rank's blocks' model state alone is over the
    device's usable memory (the module's docstring). None for a mixture of experts (its experts divide
    over ep)."""
    if shape.gpt.moe_experts:
        return None

    def beyond(spec, request: dict) -> bool:
        held = shape.gpt.n_layers * shape.layer_parameters(request["tp"]) / request["pp"]
        return held * state_bytes_per_parameter(spec, request, cluster.precision) > cluster.usable_bytes

    return beyond


def first_rank_floor(shape: ModelShape, cluster: Cluster, world: int, global_batch: int, train_precision: str):
    """`floor(spec, request, options) -> bytes`: no rank of a layout the request asks for holds less
    (the module's docstring says why); 0 for a request run_plan.py refuses before its layout exists
    (its sizes or options). `train_precision`: train.precision, which run_plan.py puts in the layout
    (the activation formulas read it). None for a mixture of experts."""
    if shape.gpt.moe_experts:
        return None

    def floor(spec, request: dict, options) -> float:
        asked = request_layout(spec, request, options, world, global_batch, train_precision)
        if asked is None:
            return 0
        strategy, layout = asked
        blocks, acts = _first_rank(shape, layout, cluster.precision, cluster.flash_attention)
        per_parameter = state_bytes_per_parameter(spec, request, cluster.precision)
        counted = _memory_py_figure(REGISTRY[strategy], shape, layout, cluster)
        return blocks * shape.layer_parameters(layout.dims.tp) * per_parameter + (acts if counted else 0)

    return floor


def _memory_py_figure(spec, shape: ModelShape, layout: Layout, cluster: Cluster) -> bool:
    """`predict.implementation_figure`, false where it cannot be asked of this layout: the strategy's
    formula is asked once per strategy and dimensions, of the first layout that comes, here before
    run_plan.py has checked it (a schedule that refuses its sizes, layers that do not split)."""
    try:
        return implementation_figure(spec, shape, layout, cluster.precision, cluster.flash_attention)
    except ValueError:  # ScheduleError, SplitError, ConfigError, LayoutError: run_plan.py will refuse it
        return False


def first_rank_over(shape: ModelShape, cluster: Cluster, world: int, global_batch: int, train_precision: str):
    """`over(spec, request, options)`: true where `first_rank_floor` is over the device's usable memory."""
    floor = first_rank_floor(shape, cluster, world, global_batch, train_precision)
    if floor is None:
        return None
    return lambda spec, request, options: floor(spec, request, options) > cluster.usable_bytes


def request_layout(spec, request: dict, options, world: int, global_batch: int,
                   precision: str) -> tuple[str, Layout] | None:
    """The registry entry that runs the request and the layout run_plan.py builds of it before checking
    it (the registry's routing applied to its options), or None where run_plan.py refuses its sizes or
    options before that."""
    if options is None:
        return None
    try:
        dims = ParallelDims(world, **{k: request[k] for k in SIZES if k in request})
        strategy, options = resolve(spec.name, dims, options)
    except (ConfigError, LayoutError, ValueError):
        return None
    m = request["microbatches"]
    if global_batch % (dims.dp * m):
        return None
    return strategy, Layout(dims=dims, microbatches=m, microbatch_size=global_batch // dims.dp // m,
                            recompute=request.get("recompute") or "none", precision=precision, options=options)


@lru_cache(maxsize=65536)
def _first_rank(shape: ModelShape, layout: Layout, precision: str, flash_attention: bool) -> tuple[int, int]:
    """(blocks, saved bytes at least) on the first pipeline rank (the module's docstring); (0, 0) where the
    layers do not split as asked (run_plan.py refuses it)."""
    dims, pipeline = layout.dims, layout.of(PPOptions)
    p, v = dims.pp, pipeline.virtual_stages if dims.pp > 1 else 1
    try:
        counts = layer_counts(shape.gpt.n_layers, p * v, list(pipeline.layers) if pipeline.layers else None)
        held = [counts[vs] for vs in schedule_placement(pipeline.schedule, p, v).vstages_of(0)]
    except (SplitError, ValueError):
        return 0, 0
    tokens, kept, working, _ = memory.block_saves(shape, layout, ACT_BYTES[precision], flash_attention)
    if p == 1:
        return held[0], int(tokens * kept * held[0]) + int(working)
    in_flight = first_rank_in_flight(pipeline.schedule, p, layout.microbatches, v)
    return sum(held), sum(count * int(tokens * kept * n) for count, n in zip(in_flight, held, strict=True))
