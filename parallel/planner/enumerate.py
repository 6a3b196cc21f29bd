"""Every valid layout of N devices, as run_plan.py itself decides validity.

The search runs over the registry and the families, not over lists of names: for each entry that
is not a PyTorch baseline (a baseline is another implementation of a layout its counterpart already
covers; one enters where `only` names it, so that its prediction can be validated), the dimensions
its rules let exceed 1 (`StrategySpec.dims`: dp, tp, pp, cp, ep) are every factorisation of N; on
each, every family says which of its options to try (`Family.search`: the
options the entry honours, from conf/plan.yaml's `plan.search`), and the requests are their product
with the microbatch counts (the divisors of the local batch) and recomputation where the training
config has it. A strategy registered later enters with its entry and its layout rules, and a
family's new option with its search, with no change here.

Each request becomes a training config (the base config of conf/config.yaml with the model's GPT
fields and the request's parallel.* fields) and goes through `parallel.run_plan.build_plan`, the
function launch.train calls before any process group exists: what it refuses is refused here,
with its message (counted by reason for the report), after one second try where a family says
what to try instead (`Family.fallback`: the naive sync where the bucketed one is refused); what it
accepts is resolved to the strategy that would run (registry routing: `parallel=tp` with pp > 1 runs
as 3d, `dp` with zero=2 as zero2) and deduplicated. Beyond run_plan.py, the planner adds one rule for
shapes the sandbox GPT does not have: grouped-query attention splits K and V heads whole, so tp
must divide the kv heads.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import product
from math import prod

from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.dist.dims import DIM, LEFTOVER, SIZES, LayoutError, ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.family import Search
from parallel.layout import FamilyOptions
from parallel.planner.remedies import sharded_stage
from parallel.registry import REGISTRY, fallback, identity, option_choices, request_fields, resolve
from parallel.run_plan import ConfigError, RunPlan, build_plan, check_recompute
from parallel.sync import all_reduce_sync
from parallel.sync.options import SyncOptions


class Config(dict):
    """A plain nested dict read like the DictConfig that build_plan takes (attribute access, .get):
    build_plan only reads, and a dict is a hundred times cheaper to copy than a DictConfig."""

    def __getattr__(self, name):
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return Config(value) if isinstance(value, dict) and not isinstance(value, Config) else value

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        return Config(value) if isinstance(value, dict) and not isinstance(value, Config) else value


class Space(dict):
    """What the search tries besides the dimensions: conf/plan.yaml's `plan.search`. Each family reads
    its own keys in its search (their defaults: every choice it knows); the search itself reads
    `max_microbatches`, `recompute`, `context_parallel` (layouts with cp > 1 where the strategy
    has the dimension) and `sizes` (dimension sizes to hold fixed)."""

    def __init__(self, **choices):
        super().__init__({k: tuple(v) if isinstance(v, list) else v for k, v in choices.items()})

    @property
    def max_microbatches(self) -> int | None:
        """A cap on the microbatch counts tried; None (the default): every divisor of the local batch."""
        return self.get("max_microbatches")

    @property
    def recompute(self) -> tuple[str, ...]:
        return self.get("recompute", ("none", "selective", "full"))

    @property
    def context_parallel(self) -> bool:
        return self.get("context_parallel") is not False  # None (launch.plan decides by precision): searched

    def holds(self, dims: dict) -> bool:
        """Whether the layout's sizes are those `sizes` fixes ({"tp": 8, "pp": 64}: only those layouts)."""
        return all(dims.get(k) == v for k, v in (self.get("sizes") or {}).items())


@dataclass(frozen=True)
class Candidate:
    requested: str  # the registry entry asked for
    plan: RunPlan  # build_plan's validated plan (plan.strategy: what runs)
    zero: int  # the ZeRO stage of the dp dimension (zero<k> strategies carry it in their name)
    grad_sync: str | None  # where it applies (dp > 1, no ZeRO, a strategy that honours it)
    request: dict = field(hash=False, compare=False)  # the parallel.* fields asked for

    @property
    def layout(self):
        return self.plan.layout


@dataclass
class Enumeration:
    candidates: list[Candidate]
    refused: Counter  # run_plan.py's (or the shape rule's) message -> how many requests it refused
    requests: int
    pruned: int = 0  # requests not asked: their model state alone is over the device (`beyond`)
    bounded: int = 0  # requests not asked: their step-time floor is above the rows kept (`floor`)
    heavy: int = 0  # requests not asked: their first pipeline rank's memory floor is over the device (`heavy`)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def zero_stage(strategy: str, plan: RunPlan) -> int:
    """The ZeRO stage of the dp dimension: the layout's (a combined layout keeps it in parallel.zero),
    or the one that the registry's routing of a pure-dp request carries in this strategy's name
    (dp with parallel.zero=2 runs as zero2, its options then saying zero=0), or for hybrid sharding the
    stage its entry shards its shard group at (parallel/planner/remedies.py)."""
    zero = plan.layout.of(SyncOptions).zero
    if zero:
        return zero
    for stage in (1, 2, 3):
        try:
            staged = plan.layout.options.with_record(replace(plan.layout.of(SyncOptions), zero=stage))
            name, options = resolve("dp", plan.dims, staged)
        except (ConfigError, LayoutError):
            continue
        if name == strategy and options.of(SyncOptions).zero == 0:
            return stage
    return sharded_stage(plan.spec, plan.model, plan.layout)  # HSDP's, in its name too


def _mesh_sizes(names: list[str], world: int, allowed) -> list[dict]:
    """Every choice of a divisor for each of `names` in turn (1 where the spec does not allow it)
    whose product divides `world`; the first name varies slowest."""
    if not names:
        return [{}]
    first, rest = names[0], names[1:]
    return [{first: size, **more} for size in (divisors(world) if first in allowed else [1])
            for more in _mesh_sizes(rest, world // size, allowed)]


def _dim_choices(spec, world: int) -> list[dict]:
    """Every layout's sizes (dims.SIZES: dp, tp, pp, cp, ep) along the dimensions the spec allows:
    the mesh's sizes multiply to the world (dp is what the others leave, as ParallelDims.resolve
    derives it), and a size carved out of another (ep out of dp) divides it."""
    allowed = spec.dims
    given = [n for n in SIZES if DIM[n].mesh and n != LEFTOVER]  # tp, pp, cp
    carved = [n for n in SIZES if DIM[n].inside]  # ep
    out = []
    for sizes in _mesh_sizes(given, world, allowed):
        left = world // prod(sizes.values())
        if left > 1 and LEFTOVER not in allowed:
            continue
        sizes[LEFTOVER] = left
        for inner in product(*[divisors(sizes[DIM[n].inside]) if n in allowed else [1] for n in carved]):
            chosen = {**sizes, **dict(zip(carved, inner))}
            out.append({n: chosen[n] for n in SIZES})
    return out


@dataclass
class Unit:
    """The requests of one registry entry that share their sizes, their pipeline record, their
    microbatch count and their recompute mode: every other family's record. They ask build_plan about
    the same (schedule, p, m, v) in a row (parallel/pp/schedules.py's cache answers the repeats), and
    share one step-time floor (parallel/planner/bounds.py reads only what they share)."""

    spec: object
    request: dict  # the sizes, the microbatches and the first family's fields
    first: object = None  # the first family's record; None: a request run_plan.py refuses for its sizes alone
    rest: list = field(default_factory=list)  # the other families' choices
    modes: tuple = (None,)  # recompute modes, or (None,) where the training config has none

    @property
    def size(self) -> int:
        return prod(len(c) for c in self.rest) * len(self.modes)

    def requests(self):
        if self.first is None:
            yield dict(self.request), None
            return
        for rest in product(*self.rest):
            options = FamilyOptions.of_records([self.first, *rest])
            request = {**self.request, **request_fields(options)}
            for recompute in self.modes:
                yield ({**request, "recompute": recompute} if recompute is not None else request), options


def _units(spec, world: int, global_batch: int, space: Space, has_recompute: bool, model: GPTConfig):
    """The search space of this registry entry, unit by unit (`Unit`). A layout on which a family has
    nothing to try (tp over a size the model's heads do not divide) is left out before any request is
    built: for a head count with few divisors that is most of a large world's sizes."""
    modes = space.recompute if has_recompute else (None,)
    # By pipeline depth first: layouts of one pp (their tp and dp differ) ask for the same schedules
    # one after another, while parallel/pp/schedules.py's cache still holds them.
    for dims in sorted(_dim_choices(spec, world), key=lambda d: (d["pp"], d["cp"], d["tp"], d["ep"])):
        if (dims["cp"] > 1 and not space.context_parallel) or not space.holds(dims):
            continue
        choices = option_choices(Search(spec, ParallelDims(world, **dims), model, space))
        if not all(choices):
            continue
        if global_batch % dims["dp"]:
            yield Unit(spec, {**dims, "microbatches": 1})  # run_plan.py refuses it with its own message
            continue
        local = global_batch // dims["dp"]
        for first in choices[0]:
            for m in [d for d in divisors(local) if space.max_microbatches is None or d <= space.max_microbatches]:
                # One unit per recompute mode: a mode's floor differs (full recomputation adds a forward), and
                # build_plan's answer for one mode answers the others (`_try_memo`) whenever they are asked.
                for mode in modes:
                    yield Unit(spec, {**dims, "microbatches": m}, first, choices[1:], (mode,))


def _requests(spec, world: int, global_batch: int, space: Space, has_recompute: bool, model: GPTConfig):
    """Every request of the search space for this registry entry, with its families' records."""
    for unit in _units(spec, world, global_batch, space, has_recompute, model):
        yield from unit.requests()


def _config(base: dict, name: str, request: dict) -> Config:
    parallel = {**base["parallel"], "name": name, **{k: v for k, v in request.items() if k != "recompute"}}
    train = {**base["train"], **({"recompute": request["recompute"]} if "recompute" in request else {})}
    return Config({**base, "parallel": parallel, "train": train})


def shape_rule(shape: ModelShape, plan: RunPlan) -> str | None:
    """The planner's one rule beyond run_plan.py: tp splits the K/V heads whole (tp divides them) or
    replicates each on tp / kv ranks (tp a multiple of them, as Megatron does); nothing in between."""
    t, kv = plan.dims.tp, shape.kv_heads
    if t > 1 and kv % t and t % kv:
        return (f"model.n_kv_heads={kv} and parallel.tp={t}: grouped-query attention splits K and V heads whole "
                f"over tp (tp dividing them) or replicates each (tp a multiple of them), so choose a tp that "
                f"divides {kv} or is a multiple of it")
    return None


def enumerate_layouts(shape: ModelShape, base: dict, world: int, global_batch: int, space: Space,
                      only: list[str] | None = None, beyond=None, floor=None, judge=None, heavy=None) -> Enumeration:
    """Every layout build_plan accepts, but those the floors rule out. `beyond(spec, request)`: true for
    a request that cannot fit whatever build_plan says (its model state alone is over the device:
    parallel/planner/memory_floor.py), which is then counted as pruned, not asked.

    `floor(request, spec)`: seconds no layout of the request is predicted under (parallel/planner/bounds.py);
    `judge`: called with each candidate kept (a new layout, or a more specific strategy for one kept),
    its `limit()` the step the search no longer needs to beat. With both, the units are asked cheapest
    floor first, a request whose floor is above the limit is counted as bounded, not asked, and once a
    unit's floor is above it every unit after it is too (they come in order of their floors).
    `heavy(spec, request, options)`: true where the first pipeline rank's memory floor is over the device
    (memory_floor.py); asked of the requests the step-time floor keeps, such a request is counted as heavy."""
    return _enumerate(shape, base, world, global_batch, space, only, beyond, floor, judge, heavy)


def _enumerate(shape: ModelShape, base: dict, world: int, global_batch: int, space: Space,
               only: list[str] | None, beyond=None, floor=None, judge=None, heavy=None) -> Enumeration:
    """Every layout of `world` devices that build_plan accepts for this model and global batch (but
    those `floor` rules out: `enumerate_layouts`).

    `base`: the training config as a plain dict (conf/config.yaml composed), whose model section
    is replaced by the shape's GPT fields. `only`: registry names to restrict the search to."""
    base = {**base, "model": {k: getattr(shape.gpt, k) for k in base["model"] if hasattr(shape.gpt, k)},
            "train": {**base["train"], "global_batch": global_batch}}
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    has_recompute = "recompute" in base["train"]
    # A PyTorch baseline enters only where `only` names it (validating its prediction): the search is of layouts.
    specs = [s for s in REGISTRY.values() if ("baseline" not in s.tags and only is None) or (only and s.name in only)]
    found = Enumeration([], Counter(), 0)
    seen: dict[tuple, Candidate] = {}
    units = [u for spec in specs for u in _units(spec, world, global_batch, space, has_recompute, shape.gpt)]
    limit = judge.limit if floor is not None and judge is not None else None
    tried: dict[str, dict] = {}  # per entry: a request without its recompute -> build_plan's answer
    ordered = _ordered(units, floor if limit else None)
    for i, (lowest, unit) in enumerate(ordered):
        if limit is not None and lowest > limit():
            found.bounded += sum(u.size for _, u in ordered[i:])
            break
        if limit is None and unit.spec.name not in tried:
            tried.clear()  # asked entry by entry: an entry's answers are not asked again once it is done
        memo = tried.setdefault(unit.spec.name, {})
        for request, options in unit.requests():
            if beyond is not None and beyond(unit.spec, request):
                found.pruned += 1
            elif limit is not None and floor(request, unit.spec) > limit():
                found.bounded += 1
            elif heavy is not None and heavy(unit.spec, request, options):
                found.heavy += 1
            else:
                _judge_request(found, seen, memo, base, shape, unit.spec, request, options, env, judge)
    found.candidates = list(seen.values())
    return found


def _ordered(units: list[Unit], floor) -> list[tuple[float, Unit]]:
    """The units with the lowest floor of their requests (their cheapest recompute mode's), cheapest
    first (in their own order among equals), or in their own order with no floor."""
    if floor is None:
        return [(0.0, u) for u in units]
    heads = [(u, {**u.request, **request_fields(FamilyOptions.of_records([u.first]))}) for u in units
             if u.first is not None]
    keyed = [(min(floor({**h, "recompute": mode}, u.spec) for mode in u.modes), u) for u, h in heads]
    keyed += [(0.0, u) for u in units if u.first is None]
    return sorted(keyed, key=lambda x: x[0])


def _judge_request(found: Enumeration, seen: dict, memo: dict, base: dict, shape: ModelShape, spec, request: dict,
                   options, env: LaunchEnv, judge) -> None:
    """Ask build_plan (and the shape rule) about one request; keep its candidate where it is a new layout or
    a more specific strategy for one kept (`_preferred`), and hand it to `judge`."""
    found.requests += 1
    plan, request = _ask(memo, base, spec.name, request, options, env, found.refused)
    if plan is None:
        return
    why = shape_rule(shape, plan)
    if why:
        found.refused[refusal_rule(why)] += 1
        return
    candidate = candidate_of(spec.name, plan, request)
    key = _key(candidate)
    kept = seen.get(key)
    if kept is None or _preferred(candidate) < _preferred(kept):
        seen[key] = candidate
        if judge is not None:
            judge(key, candidate)


def _ask(tried: dict, base: dict, name: str, request: dict, options: FamilyOptions | None, env: LaunchEnv,
         refused: Counter) -> tuple[RunPlan | None, dict]:
    """build_plan's plan for the request and the request it accepted, or None with the refusal counted;
    where a family says what to try instead of a refused record (`fallback`), that is asked once first."""
    plan, why = _try_memo(tried, base, name, request, env)
    instead = fallback(options, why) if plan is None and options is not None else None
    if instead is not None:
        request = {**request, **request_fields(instead)}
        plan, _ = _try_memo(tried, base, name, request, env)
    if plan is None:
        refused[why] += 1
    return plan, request


def _try_memo(tried: dict, base: dict, name: str, request: dict, env: LaunchEnv):
    """build_plan's answer, asked once per request without its recompute mode: every check of
    build_plan but its recompute check (`check_recompute`, which reads only the mode and the strategy)
    reads the same fields for every mode, so the modes share its answer, and a plan accepted for one
    mode is the same plan, its `recompute` replaced, for each mode the strategy takes."""
    key = _memo_key(request)
    if key not in tried:
        tried[key] = _try(base, name, {**request, "recompute": "none"} if "recompute" in request else request, env)
    plan, why = tried[key]
    mode = request.get("recompute")
    if plan is None or mode is None or mode == plan.layout.recompute:
        return plan, why
    try:
        check_recompute(mode, plan.strategy, plan.spec)
    except ConfigError as e:
        return None, refusal_rule(str(e))
    return replace(plan, layout=replace(plan.layout, recompute=mode)), ""


def _memo_key(request: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in request.items() if k != "recompute"))


def _try(base: dict, name: str, request: dict, env: LaunchEnv) -> tuple[RunPlan | None, str]:
    try:
        return build_plan(_config(base, name, request), env, cuda_available=False, planning=True,
                          replay_schedule=False), ""
    except (ConfigError, LayoutError) as e:
        return None, refusal_rule(str(e))


def refusal_rule(message: str) -> str:
    """A refusal's message with its numbers blanked, so that refusals count by rule, not by value."""
    return re.sub(r"\d+", "N", message.split(":")[0])[:160]


def candidate_of(requested: str, plan: RunPlan, request: dict) -> Candidate:
    """The candidate of an accepted request: its ZeRO stage (a zero<k> strategy's in its name), and its
    all-reduce sync where one runs (`all_reduce_sync`: not under ZeRO, not with one dp rank)."""
    zero = zero_stage(plan.strategy, plan)
    grad_sync = plan.layout.of(SyncOptions).grad_sync if all_reduce_sync(plan.layout, plan.spec) and not zero else None
    return Candidate(requested, plan, zero, grad_sync, request)


def _preferred(c: Candidate) -> tuple:
    """Of several strategies that run one layout (dp over 4 ranks is `dp`, and also `pp` or `3d` with
    one stage), the one whose registry entry splits along the fewest dimensions: the most specific;
    then a request that names the strategy that runs (zero1 rather than dp with parallel.zero=1)."""
    return (len(c.plan.spec.dims), c.requested != c.plan.strategy)


def _key(c: Candidate) -> tuple:
    """Requests that run the same layout are one candidate (whichever strategy runs it: `_preferred`):
    what each family's options change of the run (`Family.identity`: two schedule names that give the
    same action lists are one), the effective ZeRO stage and all-reduce sync, the recomputation. A named
    PyTorch baseline stays a row of its own beside the layout of ours it is the counterpart of."""
    layout = c.layout
    baseline = c.plan.strategy if "baseline" in c.plan.spec.tags else None
    return (layout.dims, layout.microbatches, layout.microbatch_size, identity(layout, c.plan.spec), c.zero,
            c.grad_sync, c.request.get("recompute"), baseline)
