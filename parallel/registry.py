"""Every strategy in one table: how it is built, what layout it needs, what it sends and holds.

A `StrategySpec` is all the rest of the project knows about a strategy. The training loop builds
it (`build`), plan.py checks a layout against it (`layout rules`, then `check`), the summary
compares a run with its closed forms (`comm`, `model_state`, `local_parameters`: functions of
the families' theory.py on the model and the `Layout`), and the comparison pairs it with its PyTorch
counterpart (`counterpart`). Nothing else branches on a strategy's name.

Adding a strategy is one module in its family (the Strategy subclass) and one entry here:

    register(StrategySpec(
        name="my_dp", description="...", build=lambda model, plan, ctx: MyDP(model, ...),
        comm=theory.dp_comm, model_state=theory.replicated_model_state_bytes, min_world=2,
    ))

and a preset conf/parallel/my_dp.yaml with `name: my_dp` (tests/runs/test_registry.py does exactly this).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from parallel.core.model import GPTConfig
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.layout import Layout


class ConfigError(ValueError):
    """A configuration value that cannot run."""


@dataclass(frozen=True)
class StrategySpec:
    name: str
    description: str  # one line, for --help and the docs
    build: Callable  # (model, plan, ctx) -> Strategy: the model is the full GPT, built from the seed on every rank
    comm: Callable[[GPTConfig, Layout], dict]  # theory: traffic per step, all ranks, the summary's expected_comm
    model_state: Callable[[GPTConfig, Layout], dict | None] = lambda cfg, layout: None  # theory: bytes per rank
    local_parameters: Callable[[GPTConfig, Layout], int | None] = lambda cfg, layout: None  # what rank 0 holds
    # theory: bytes saved for backward at the step's peak, per rank (a list, rank order), or None
    activations: Callable[[GPTConfig, Layout], list[int] | None] = lambda cfg, layout: None
    # -- layout rules (checked by `check_layout`, before any process group) --
    dims: frozenset = frozenset({"dp"})  # dimensions that may exceed 1
    min_world: int = 1
    max_world: int | None = None
    tensor_parallel: bool = False  # the model is cut over tp: heads, vocabulary, sequence must divide
    pipelined: bool = False  # parallel.schedule, virtual_stages, pp_layers apply; the summary gets a pipeline block
    sequence_parallel: bool = False  # accepts parallel.sequence_parallel=true
    check: Callable | None = None  # (dims, options) -> None, raising LayoutError/ConfigError: rules of its own
    check_model: Callable | None = None  # (GPTConfig, dims) -> None, raising: its rules that need the model
    # -- mixture of experts (model.moe_experts > 0) --
    moe: bool = False  # trains MoE models: the balancing loss in its loss, every expert's gradient summed right
    moe_refusal: str = ""  # where moe is False: why, for the error line
    # (schedule, pp, microbatches, virtual) -> None, raising ScheduleError: a pipelined strategy's own
    # rule on top of the schedule's (PyTorch's pipelining refuses some (p, m) that ours runs)
    schedule_check: Callable | None = None
    # -- what it honours and supports --
    grad_sync: bool = False  # parallel.grad_sync (naive | bucketed) and bucket_mb
    bucket_mb: bool = False  # parallel.bucket_mb alone (PyTorch's DDP)
    zero_dp: bool = False  # parallel.zero sets the ZeRO stage of its dp dimension
    recompute: bool = False  # train.recompute (selective | full) applies: parallel/core/recompute.py's transform
    cp_kind: str | None = None  # context parallelism: the attention it asks for ("ring" | "a2a"), carried by routes
    checkpoints: bool = True  # train.checkpoint_every / train.resume
    exposed_comm_measured: bool = True  # false where it waits inside PyTorch, out of the log's sight
    counterpart: str | None = None  # PyTorch's implementation of the same idea, for the comparison's ratio
    route: Callable | None = None  # (dims, options) -> another name this layout is run as, or None
    tags: frozenset = field(default_factory=frozenset)  # "baseline" for PyTorch's own, "sharded" for ZeRO-like


REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    if spec.name in REGISTRY:
        raise ValueError(f"strategy {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    return spec


def spec_of(name: str) -> StrategySpec:
    if name not in REGISTRY:
        raise ConfigError(f"parallel.name={name!r} is not a strategy: choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


# -- layout rules -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """The layout options a strategy's rules look at (the rest of the config is checked elsewhere)."""

    sequence_parallel: bool = False
    zero: int = 0
    cp_kind: str = "ring"  # the attention across cp ranks; the requested spec's `cp_kind` sets it


def resolve(name: str, dims: ParallelDims, options: Options) -> tuple[str, Options]:
    """The strategy that runs a requested name on this layout, by each spec's `route`, then the
    ZeRO stage of the dp dimension. Returns (name, options as they apply to it)."""
    spec = spec_of(name)
    if spec.cp_kind is not None:  # `cp_a2a` asks for the all-to-all wherever its layout is routed
        options = replace(options, cp_kind=spec.cp_kind)
    seen = {name}
    while spec.route is not None:
        routed = spec.route(dims, options)
        if routed is None:
            break
        name, options = routed
        if name in seen:
            raise AssertionError(f"strategy routes loop through {name}")
        seen.add(name)
        spec = spec_of(name)
    return _route_zero(name, dims, options)


ZERO_STAGES = (0, 1, 2, 3)


def _route_zero(name: str, dims: ParallelDims, options: Options) -> tuple[str, Options]:
    """parallel.zero picks how the dp dimension syncs. On a pure dp layout it is the zero<k>
    strategy; with tp or pp it is the 3d strategy (one code path, pp=1 or tp=1 included), whose dp
    sync becomes a ZeroOptimizer over the dp group. Refused where it means nothing."""
    zero = options.zero
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ConfigError(f"parallel.zero={zero!r} is not a ZeRO stage: choose 0 (plain dp all-reduce), 1 or 2 "
                          "(3 only with parallel.tp=1 parallel.pp=1)")
    if zero == 0:
        return name, options
    spec = spec_of(name)
    if not spec.zero_dp:
        why = "is a ZeRO stage already" if name.startswith("zero") else "has no such dp sync"
        raise ConfigError(f"parallel.zero={zero} sets the ZeRO stage of the dp dimension of parallel=dp, tp, pp, cp or "
                          f"3d, but parallel={name} {why}: set parallel.zero=0")
    if dims.cp > 1:
        return _route_zero_with_cp(name, dims, options)
    if dims.dp < 2:
        raise LayoutError(
            f"parallel.zero={zero} shards over the data-parallel ranks, but parallel.dp={dims.dp} "
            f"(world {dims.world_size} = dp {dims.dp} x tp {dims.tp} x pp {dims.pp}): "
            "use at least 2 dp ranks, or parallel.zero=0"
        )
    if dims.tp == 1 and dims.pp == 1:
        return f"zero{zero}", replace(options, zero=0)  # the stage is in the strategy's name
    if zero == 3:
        raise ConfigError(
            f"parallel.zero=3 does not compose with parallel.tp={dims.tp} parallel.pp={dims.pp} here: "
            "ZeRO-3 all-gathers "
            "each part's parameters before every microbatch's forward and again before its backward (2m gathers of "
            "every stage per step under a pipeline schedule, which wants m large), reduce-scatters gradients inside "
            "backward (before sequence parallelism's tp sum of partial gradients) and frees parameters that the tp and "
            "pp strategies read; use parallel.zero=1 or 2, or parallel=zero3 with parallel.tp=1 parallel.pp=1"
        )
    return "3d", options


def _route_zero_with_cp(name: str, dims: ParallelDims, options: Options) -> tuple[str, Options]:
    """Under context parallelism every parameter is replicated over dp x cp, so ZeRO-1/2 shards over
    those dp·cp ranks (the "dp_cp" group), inside the strategy that runs the layout (cp, cp_a2a or 3d)."""
    if options.zero == 3:
        raise ConfigError(
            f"parallel.zero=3 does not compose with parallel.cp={dims.cp}: ZeRO-3 is a strategy of its own "
            "(parallel=zero3, parameters gathered and freed by hooks around each part of the whole model), not a "
            "dp sync that the cp strategy or the 3d recipe can plug in; use parallel.zero=1 or 2"
        )
    return name, options


def check_layout(name: str, dims: ParallelDims, options: Options) -> StrategySpec:
    """The spec's generic rules; its own `check` last. Messages name the value and the fix."""
    spec = spec_of(name)
    if spec.max_world is not None and dims.world_size > spec.max_world:
        raise LayoutError(
            f"parallel={name} runs one process but the world size is {dims.world_size}: "
            f"run `python -m launch.train parallel={name}`, or use parallel=dp under torchrun"
        )
    if dims.world_size < spec.min_world:
        what = ("shards the model state over data-parallel ranks and needs" if "sharded" in spec.tags else "needs")
        raise LayoutError(
            f"parallel={name} {what} at least {spec.min_world} processes, got world size {dims.world_size}: "
            f"launch it with torchrun --nproc-per-node {spec.min_world} (or more)"
        )
    if spec.check is not None:
        spec.check(dims, options)
    extra = [d for d in ("dp", "tp", "pp", "cp", "ep") if getattr(dims, d) > 1 and d not in spec.dims]
    if extra and spec.dims == {"dp"} and set(extra) <= {"tp", "pp"}:
        raise LayoutError(
            f"parallel={name} is data parallel only, but parallel.tp={dims.tp} and parallel.pp={dims.pp}: "
            "set parallel.tp=1 parallel.pp=1, or use parallel=tp for tensor parallelism"
        )
    if extra:
        hint = " (context parallelism: parallel=cp or cp_a2a)" if "cp" in extra else ""
        raise LayoutError(f"parallel={name} does not split along {', '.join(extra)}: set "
                          + " ".join(f"parallel.{d}=1" for d in extra) + hint)
    if options.sequence_parallel and (not spec.sequence_parallel or dims.tp == 1):
        raise ConfigError(
            f"parallel.sequence_parallel=true needs tensor parallelism, "
            f"but parallel={name} with parallel.tp={dims.tp}: "
            "use parallel=tp_sp (with parallel.tp > 1) or set parallel.sequence_parallel=false"
        )
    return spec


def check_model(name: str, model: GPTConfig, dims: ParallelDims) -> None:
    """Whether strategy `name` trains this model: a mixture of experts only where its entry says
    `moe=True` (the refusal gives the entry's reason), then the entry's own model rules."""
    spec = spec_of(name)
    if model.moe_experts and not spec.moe:
        trains = ", ".join(n for n, s in REGISTRY.items() if s.moe)
        why = spec.moe_refusal or "its registry entry does not say it trains MoE blocks (moe=True)"
        raise ConfigError(f"parallel={name} does not train a mixture-of-experts model (model.moe_experts="
                          f"{model.moe_experts}): {why}; use one of {trains}, or a dense model (model.moe_experts=0)")
    if spec.check_model is not None:
        spec.check_model(model, dims)


# -- theory by strategy name (tests, benches and tools that have a name, a model and a layout) ----------
def layout_of(dims: ParallelDims | Layout, **options) -> Layout:
    """A Layout from dims and keyword options (`virtual=` is accepted for `virtual_stages=`)."""
    if isinstance(dims, Layout):
        return dims
    if "virtual" in options:
        options["virtual_stages"] = options.pop("virtual")
    if options.get("pp_layers") is not None:
        options["pp_layers"] = tuple(options["pp_layers"])
    return Layout(dims=dims, **options)


def expected_comm(name: str, cfg: GPTConfig, dims: ParallelDims | Layout, **options) -> dict:
    """The closed-form traffic of strategy `name` per step on this model and layout (the summary's expected_comm)."""
    return spec_of(name).comm(cfg, layout_of(dims, **options))


def model_state_bytes(name: str, cfg: GPTConfig, dims: ParallelDims | Layout, **options) -> dict | None:
    """The closed-form model-state bytes per rank of strategy `name` (None where it has no one formula)."""
    return spec_of(name).model_state(cfg, layout_of(dims, **options))


# The entries live in parallel/strategies.py, which imports every family; importing it here, at
# the end, fills REGISTRY whenever the registry is used.
from parallel import strategies  # noqa: E402,F401
