"""Every strategy in one table, gathered from the families: how it is built, what layout it needs,
what it sends and holds.

Each family declares its entries in its own __init__.py as `ENTRIES`, a tuple of StrategySpec
records (parallel/spec.py): parallel/dp, zero, tp, cp and moe; the recipe's `pp` and `3d` are
parallel/compose's, PyTorch's own parallel/baselines'. `REGISTRY` is built here once from them, in
that order (the order error messages list names in), and nothing rewrites an entry afterwards.
Which entry runs a requested layout is parallel/compose/route.py's table; the rules every entry
shares are `check_layout`, `check_model` and `check_tied_head` below, each entry's own are its `check`,
`check_model` and `schedule_check` (in its family's rules.py).

The families are gathered here too (`FAMILIES`: each folder's `Family` record, parallel/family.py),
and the functions below are what the run validator, the planner and the summary know of them:
every family's options parsed (`parse_options`), its rules run (`check_rules`), its fields
described and labelled (`describe`, `label`), its searches multiplied out (`option_choices`). None
of those callers names a family or an option.

Adding a strategy is one module in its family (the Strategy subclass), one entry in the family's
`ENTRIES`:

    StrategySpec(
        name="my_dp", description="...", build=_build_my_dp,  # imports parallel.dp.my_dp inside
        comm=dp_theory.dp_comm, model_state=dp_theory.replicated_model_state_bytes, min_world=2,
    ),

and a preset conf/parallel/my_dp.yaml with `name: my_dp`. A strategy from outside the project is
added at run time with `register` (tests/helpers/toy_strategy.py does exactly this).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

from parallel import algebra, baselines, compose, cp, diloco, dp, moe, pp, sync, tp, zero
from parallel.activations import registry_activations
from parallel.compose import route
from parallel.core.model import GPTConfig
from parallel.core.optim import OPTIMIZERS
from parallel.dist.dims import SIZES, LayoutError, ParallelDims
from parallel.dp import theory as dp_theory
from parallel.family import Check, Family, Search, option_keys
from parallel.layout import FamilyOptions, Layout
from parallel.spec import ConfigError, StrategySpec

__all__ = ["FAMILIES", "REGISTRY", "ConfigError", "StrategySpec", "check_layout", "check_model", "check_optimizer",
           "check_rules", "check_tied_head",
           "describe", "expected_comm", "layout_of", "model_state_bytes", "parse_options", "register", "spec_of"]


def _build_single(model, plan, ctx):
    from parallel.strategy import SingleProcess, plan_optimizer

    return SingleProcess(model, plan_optimizer(model, plan))


# The reference belongs to no family: parallel/strategy.py's SingleProcess, which dp, pp and 3d run
# as in one plain process (parallel/compose/route.py) and every strategy is compared with.
SINGLE = StrategySpec(
    name="single", description="one process, no communication: the reference every strategy is compared with",
    build=_build_single, comm=algebra.no_comm, model_state=dp_theory.replicated_model_state_bytes,
    local_parameters=algebra.tp_local_parameter_count, max_world=1, dims=frozenset(), moe=True,
    activations=registry_activations, recompute=True, tied_head=True, sgd=True,
)


def _table(entries: Iterable[StrategySpec]) -> dict[str, StrategySpec]:
    table: dict[str, StrategySpec] = {}
    for spec in entries:
        if spec.name in table:
            raise ValueError(f"strategy {spec.name!r} is registered twice")
        table[spec.name] = spec
    return table


REGISTRY: dict[str, StrategySpec] = _table(chain(
    (SINGLE,), dp.ENTRIES, zero.ENTRIES, tp.ENTRIES, pp.ENTRIES, compose.ENTRIES, baselines.ENTRIES, moe.ENTRIES,
    cp.ENTRIES, diloco.ENTRIES,
))


route.check_names(REGISTRY)  # the table names only entries that exist

# Every family's declaration (parallel/family.py), in the order their rules run and their fields are
# described and labelled.
FAMILIES: tuple[Family, ...] = (tp.FAMILY, cp.FAMILY, pp.FAMILY, sync.FAMILY, moe.FAMILY, diloco.FAMILY)
WITH_OPTIONS: tuple[Family, ...] = tuple(f for f in FAMILIES if f.options is not None)
# The planner's product of the families' searches varies the first slowest: the pipeline's schedules,
# so that every other option of one schedule asks for it while parallel/pp/schedules.py's cache holds it.
SEARCHED: tuple[Family, ...] = (pp.FAMILY, sync.FAMILY, tp.FAMILY, cp.FAMILY, diloco.FAMILY)


def check_declarations(spec: StrategySpec) -> None:
    """An entry's `honours` and `sets` name families that have options, and options they have: a
    misspelt name would otherwise read as an option the entry does not take."""
    options = {family.name: family.options for family in WITH_OPTIONS}
    for family, names in [*spec.honours.items(), *((f, tuple(v)) for f, v in spec.sets.items())]:
        if family not in options:
            raise ValueError(f"strategy {spec.name!r} names family {family!r}: choose one of {', '.join(options)}")
        for name in names:
            spec.honours_option(options[family], name)  # refuses a name the family does not have


for _spec in REGISTRY.values():
    check_declarations(_spec)


def register(spec: StrategySpec) -> StrategySpec:
    """A strategy added at run time, from outside the project's families (tests/helpers/toy_strategy.py)."""
    if spec.name in REGISTRY:
        raise ValueError(f"strategy {spec.name!r} is registered twice")
    check_declarations(spec)
    REGISTRY[spec.name] = spec
    return spec


def spec_of(name: str) -> StrategySpec:
    if name not in REGISTRY:
        raise ConfigError(f"parallel.name={name!r} is not a strategy: choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


# -- the layout rules every entry shares ----------------------------------------------------------------
def resolve(name: str, dims: ParallelDims, options: FamilyOptions) -> tuple[str, FamilyOptions]:
    """The entry that runs a requested name on this layout: parallel/compose/route.py's table read
    over this registry. Returns (name, options as they apply to it)."""
    spec_of(name)  # an unknown name is refused by name first
    return route.resolve(name, dims, options, REGISTRY)


def check_layout(name: str, dims: ParallelDims) -> StrategySpec:
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
        spec.check(dims)
    extra = [d for d in SIZES if getattr(dims, d) > 1 and d not in spec.dims]
    if extra and spec.dims == {"dp"} and set(extra) <= {"tp", "pp"}:
        raise LayoutError(
            f"parallel={name} is data parallel only, but parallel.tp={dims.tp} and parallel.pp={dims.pp}: "
            "set parallel.tp=1 parallel.pp=1, or use parallel=tp for tensor parallelism"
        )
    if extra:
        hint = " (context parallelism: parallel=cp or cp_a2a)" if "cp" in extra else ""
        raise LayoutError(f"parallel={name} does not split along {', '.join(extra)}: set "
                          + " ".join(f"parallel.{d}=1" for d in extra) + hint)
    return spec


def check_model(name: str, model: GPTConfig, dims: ParallelDims) -> None:
    """Whether strategy `name` trains this model: a mixture of experts only where its entry says
    `moe=True` (the refusal gives the entry's reason), then the entry's own model rules."""
    spec = spec_of(name)
    if model.moe_experts and not spec.moe:
        raise _not_trained(name, f"a mixture-of-experts model (model.moe_experts={model.moe_experts})",
                           spec.moe_refusal or "its registry entry does not say it trains MoE blocks (moe=True)",
                           "moe", "a dense model (model.moe_experts=0)")
    if spec.check_model is not None:
        spec.check_model(model, dims)


def check_tied_head(name: str, model: GPTConfig) -> None:
    """Whether strategy `name`'s code here trains a head tied to the token table: only where its
    entry says `tied_head=True` (the refusal gives the entry's reason). A run's rule, not a
    planner's: Megatron trains a tied head across pipeline stages (it all-reduces the two copies'
    gradients), which the planner counts (parallel/planner/traffic.py) and this code does not."""
    spec = spec_of(name)
    if model.tied_head and not spec.tied_head:
        raise _not_trained(name, "a head tied to the token table (model.tied_head=true)",
                           spec.tied_head_refusal or "its registry entry does not say it trains a tied head "
                                                     "(tied_head=True)",
                           "tied_head", "an untied head (model.tied_head=false)")


def check_optimizer(name: str, optimizer) -> None:
    """train.optimizer is one of parallel/core/optim.py's, and sgd only where the entry builds its
    optimizer with strategy.plan_optimizer (`sgd=True`)."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if optimizer == "sgd" and not spec_of(name).sgd:
        takes = ", ".join(n for n, s in REGISTRY.items() if s.sgd)
        raise ConfigError(f"train.optimizer=sgd: parallel={name} builds an AdamW of its own (its registry entry says "
                          f"sgd=False): set train.optimizer=adamw, or use one of {takes}")


def _not_trained(name: str, what: str, why: str, flag: str, instead: str) -> ConfigError:
    """The one line a model's refusal reads: the strategy, what of the model, the entry's reason, and
    the fix (the entries whose `flag` says they train it, or the model without it)."""
    trains = ", ".join(n for n, s in REGISTRY.items() if getattr(s, flag))
    return ConfigError(f"parallel={name} does not train {what}: {why}; use one of {trains}, or {instead}")


# -- the families' options ------------------------------------------------------------------------------
def parse_options(section) -> FamilyOptions:
    """Every family's record from the `parallel` config section (each checks its own values)."""
    return FamilyOptions.of_records(family.parse(section) for family in WITH_OPTIONS)


def check_rules(check: Check) -> None:
    """Every family's refusals, in `FAMILIES` order."""
    for family in FAMILIES:
        if family.rules is not None:
            family.rules(check)


def describe(layout: Layout, spec: StrategySpec) -> dict:
    """The families' fields of the `parallel` block of summary.json and of a planner row."""
    out = {}
    for family in FAMILIES:
        if family.describe is not None:
            out.update(family.describe(layout, spec))
    return out


def label(described: dict) -> list[str]:
    """The families' words in a planner row's label (`2x4x8 m16 1f1b v2 sp zero1`), from `describe`'s fields."""
    return [word for family in FAMILIES if family.label is not None for word in family.label(described)]


def identity(layout: Layout, spec: StrategySpec) -> tuple:
    """What the families' options change of the run: two requests with the same identity run the same layout."""
    return tuple(family.identity(layout, spec) if family.identity is not None else layout.of(family.options)
                 for family in WITH_OPTIONS)


def option_choices(search: Search) -> list[list]:
    """Each family's records to try on one layout (the defaults where it searches nothing), in `SEARCHED` order."""
    return [list(family.search(search)) if family.search is not None else [family.options()]
            for family in SEARCHED]


def request_fields(options: FamilyOptions, differing_from: dict | None = None) -> dict:
    """The `parallel.*` config fields that ask for these records: every configurable option, or with
    `differing_from` (a request's fields) those of it whose value differs from the records'."""
    out = {}
    for family in WITH_OPTIONS:
        record = options.of(family.options)
        for key, name in option_keys(family.options, configurable_only=True).items():
            if differing_from is None:
                out[key] = getattr(record, name)
            elif key in differing_from and _normal(differing_from[key]) != _normal(getattr(record, name)):
                out[key] = differing_from[key]
    return out


def _normal(value):
    return tuple(value) if isinstance(value, list) else value


def differing_options(a: FamilyOptions, b: FamilyOptions, spec: StrategySpec) -> int:
    """How many of the options `spec` honours differ between two sets of records."""
    return sum(getattr(a.of(family.options), name) != getattr(b.of(family.options), name)
               for family in WITH_OPTIONS for name in spec.honours.get(family.name, ()))


def fallback(options: FamilyOptions, reason: str) -> FamilyOptions | None:
    """The records to try once a request with `options` was refused for `reason`, where a family has one."""
    for family in WITH_OPTIONS:
        if family.fallback is not None:
            instead = family.fallback(options.of(family.options), reason)
            if instead is not None:
                return options.with_record(instead)
    return None


# -- theory by strategy name (tests, benches and tools that have a name, a model and a layout) ----------
def layout_of(dims: ParallelDims | Layout, **options) -> Layout:
    """A Layout from dims and keyword options: the Layout's own fields (microbatches, microbatch_size,
    recompute, precision, dtype_bytes) and any family's option by its config key (sequence_parallel,
    schedule, virtual_stages or `virtual`, zero, cp_kind, ...)."""
    if isinstance(dims, Layout):
        return dims
    if "virtual" in options:
        options["virtual_stages"] = options.pop("virtual")
    records = []
    for family in WITH_OPTIONS:
        mine = {name: options.pop(key) for key, name in option_keys(family.options).items() if key in options}
        records.append(family.options(**mine))
    return Layout(dims=dims, options=FamilyOptions.of_records(records), **options)


def expected_comm(name: str, model: GPTConfig, dims: ParallelDims | Layout, **options) -> dict:
    """The closed-form traffic of strategy `name` per step on this model and layout (the summary's expected_comm)."""
    return spec_of(name).comm(model, layout_of(dims, **options))


def model_state_bytes(name: str, model: GPTConfig, dims: ParallelDims | Layout, **options) -> dict | None:
    """The closed-form model-state bytes per rank of strategy `name` (None where it has no one formula)."""
    return spec_of(name).model_state(model, layout_of(dims, **options))
