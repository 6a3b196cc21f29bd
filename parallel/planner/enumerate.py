"""Every valid layout of N devices, as plan.py itself decides validity.

The search runs over the registry, not over a list of strategy names: for each entry that is not
a PyTorch baseline (a baseline is another implementation of a layout its counterpart already
covers), the dimensions its rules let exceed 1 (`StrategySpec.dims`: dp, tp, pp, cp, ep) are
every factorisation of N, and the options it honours are tried: the ZeRO stage of its dp
dimension (`zero_dp`), sequence parallelism (`sequence_parallel`), schedules and virtual stages
(`pipelined`), microbatches (the divisors of the local batch), the dp sync (`grad_sync`), and
recomputation where the training config has it. A strategy registered later enters with its
entry and its layout rules, with no change here.

Each request becomes a training config (the base config of conf/config.yaml with the model's GPT
fields and the request's parallel.* fields) and goes through `parallel.plan.build_plan`, the
function launch.train calls before any process group exists: what it refuses is refused here,
with its message (counted by reason for the report); what it accepts is resolved to the strategy
that would run (registry routing: `parallel=tp` with pp > 1 runs as 3d, `dp` with zero=2 as zero2)
and deduplicated. Beyond plan.py, the planner adds one rule for shapes the sandbox GPT does not
have: grouped-query attention splits K and V heads whole, so tp must divide the kv heads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import product
from math import prod

from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.dist.dims import DIM, LEFTOVER, SIZES, LayoutError, ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.plan import ConfigError, RunPlan, _check_recompute, build_plan
from parallel.pp.schedules import SCHEDULES, built_schedule
from parallel.registry import REGISTRY, Options, resolve, sequence_piece_keepers
from parallel.tp.rules import TP_SAVES, check_tp_saves, tp_cut_refusal


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


@dataclass(frozen=True)
class Space:
    """What the search tries besides the dimensions (conf/plan.yaml `plan.search`)."""

    zero: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = field(default_factory=lambda: tuple(SCHEDULES))  # those registered by then
    virtual_stages: tuple[int, ...] = (1, 2, 4)
    max_microbatches: int = 64
    grad_sync: tuple[str, ...] = ("bucketed",)  # each refused one falls back to naive
    recompute: tuple[str, ...] = ("none", "selective", "full")
    context_parallel: bool = True  # layouts with cp > 1 where the strategy has the dimension
    uneven_stages: bool = True  # propose balanced parallel.pp_layers where the layers do not divide


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
    refused: Counter  # plan.py's (or the shape rule's) message -> how many requests it refused
    requests: int
    pruned: int = 0  # requests not asked: their model state alone is over the device (`beyond`)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def balanced_layers(n_layers: int, pieces: int) -> list[int] | None:
    """An uneven split for parallel.pp_layers: every piece floor(L/pieces) blocks, the remainder one
    more each on the middle pieces (the first holds the embedding, the last the head)."""
    if pieces > n_layers or n_layers % pieces == 0:
        return None
    base, extra = divmod(n_layers, pieces)
    order = sorted(range(pieces), key=lambda i: (i in (0, pieces - 1), abs(i - (pieces - 1) / 2)))
    counts = [base] * pieces
    for i in order[:extra]:
        counts[i] += 1
    return counts


def zero_stage(strategy: str, plan: RunPlan) -> int:
    """The ZeRO stage of the dp dimension: the layout's (a combined layout keeps it in parallel.zero),
    or the one that the registry's routing of a pure-dp request carries in this strategy's name
    (dp with parallel.zero=2 runs as zero2, its options then saying zero=0)."""
    if plan.zero:
        return plan.zero
    for stage in (1, 2, 3):
        try:
            name, options = resolve("dp", plan.dims, Options(False, stage))
        except (ConfigError, LayoutError):
            continue
        if name == strategy and options.zero == 0:
            return stage
    return 0


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


def _tp_saves(spec, world: int, dims: dict) -> tuple[str, ...]:
    """What a sequence-parallel request may ask of parallel.tp_saves: gathered always, sharded too
    where tp's own rule (`check_tp_saves`) takes it for this strategy and layout (not with cp > 1).
    Its last clause, no zero-bubble schedule, needs the schedule built: build_plan checks it, asked
    only for the requests whose gathered twin it accepted (`_try_memo`), whose schedule it has just built."""
    try:
        check_tp_saves("sharded", spec, sequence_piece_keepers(), ParallelDims(world, **dims), True, False)
    except LayoutError:
        return ("gathered",)
    return TP_SAVES


def _requests(spec, world: int, global_batch: int, n_layers: int, space: Space, has_recompute: bool,
              model: GPTConfig | None = None):
    """Every request of the search space for this registry entry. `model`: where given, the tp sizes
    (and, under sequence parallelism, the sequence cuts) that tp's own rule refuses for it
    (`tp_cut_refusal`, the predicate plan.py raises on) are left out before any request is built:
    for a head count with few divisors they are most of the space (128 heads on 2,520 devices)."""
    # By pipeline depth first: layouts of one pp (their tp and dp differ) ask for the same schedules
    # one after another, while parallel/pp/schedules.py's cache still holds them.
    for dims in sorted(_dim_choices(spec, world), key=lambda d: (d["pp"], d["cp"], d["tp"], d["ep"])):
        if dims["cp"] > 1 and not space.context_parallel:
            continue
        cuts = model is not None and spec.tensor_parallel and dims["tp"] > 1
        if cuts and tp_cut_refusal(model, dims["tp"], False):
            continue
        sp_options = space.sequence_parallel if spec.sequence_parallel and dims["tp"] > 1 else (False,)
        if cuts and tp_cut_refusal(model, dims["tp"], True):
            sp_options = tuple(sp for sp in sp_options if not sp)
        sharded_too = _tp_saves(spec, world, dims) if True in sp_options else ()
        if global_batch % dims["dp"]:
            yield {**dims, "microbatches": 1}  # plan.py refuses it with its own message
            continue
        local = global_batch // dims["dp"]
        pipelined = spec.pipelined and dims["pp"] > 1
        schedules = [(s, v) for s in space.schedules for v in space.virtual_stages] if pipelined \
            else [("1f1b", 1)]
        # The pipeline's (schedule, v, m) vary slowest: build_plan checks a pipeline by building its schedule,
        # and every zero stage and option of one (schedule, p, m, v) then asks for it in a row, which
        # parallel/pp/schedules.py's cache answers.
        for schedule, v in schedules:
            pieces = dims["pp"] * v
            pp_layers = balanced_layers(n_layers, pieces) if pipelined and space.uneven_stages else None
            for m in [d for d in divisors(local) if d <= space.max_microbatches]:
                for zero in space.zero if spec.zero_dp else (0,):
                    for sp in sp_options:
                        saves_options = sharded_too if sp else ("gathered",)
                        for saves, recompute in product(saves_options, space.recompute if has_recompute else (None,)):
                            request = {**dims, "zero": zero, "sequence_parallel": sp, "schedule": schedule,
                                       "virtual_stages": v, "microbatches": m,
                                       "pp_layers": pp_layers}
                            if saves != "gathered":
                                request["tp_saves"] = saves
                            if recompute is not None:
                                request["recompute"] = recompute
                            yield request


def _config(base: dict, name: str, request: dict, grad_sync: str) -> Config:
    parallel = {**base["parallel"], "name": name, "grad_sync": grad_sync,
                **{k: v for k, v in request.items() if k != "recompute"}}
    train = {**base["train"], **({"recompute": request["recompute"]} if "recompute" in request else {})}
    return Config({**base, "parallel": parallel, "train": train})


def shape_rule(shape: ModelShape, plan: RunPlan) -> str | None:
    """The planner's one rule beyond plan.py: tp must divide the K/V heads (grouped-query attention)."""
    t = plan.dims.tp
    if t > 1 and shape.kv_heads % t:
        return (f"model.n_kv_heads={shape.kv_heads} is not divisible by parallel.tp={t}: grouped-query attention "
                "splits K and V heads whole over tp")
    return None


def enumerate_layouts(shape: ModelShape, base: dict, world: int, global_batch: int, space: Space,
                      only: list[str] | None = None, beyond=None) -> Enumeration:
    """build_plan checks a pipeline by building its schedule; the search asks that of the same
    (schedule, p, m, v) for every ZeRO stage and option, thousands of times for a large world, and
    parallel/pp/schedules.py answers the repeats from its cache (`built_schedule`). `beyond(spec,
    request)`: true for a request that cannot fit whatever build_plan says (its model state alone is
    over the device: parallel/planner/search.py), which is then counted as pruned, not asked."""
    return _enumerate(shape, base, world, global_batch, space, only, beyond)


def _enumerate(shape: ModelShape, base: dict, world: int, global_batch: int, space: Space,
               only: list[str] | None, beyond=None) -> Enumeration:
    """Every layout of `world` devices that build_plan accepts for this model and global batch.

    `base`: the training config as a plain dict (conf/config.yaml composed), whose model section
    is replaced by the shape's GPT fields. `only`: registry names to restrict the search to."""
    base = {**base, "model": {k: getattr(shape.gpt, k) for k in base["model"] if hasattr(shape.gpt, k)},
            "train": {**base["train"], "global_batch": global_batch}}
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    has_recompute = "recompute" in base["train"]
    specs = [s for s in REGISTRY.values() if "baseline" not in s.tags and (only is None or s.name in only)]
    seen: dict[tuple, Candidate] = {}
    refused: Counter = Counter()
    requests = 0
    pruned = 0
    for spec in specs:
        tried: dict[tuple, tuple[RunPlan | None, str]] = {}  # a request without its recompute -> build_plan's answer
        for request in _requests(spec, world, global_batch, shape.gpt.n_layers, space, has_recompute, shape.gpt):
            if beyond is not None and beyond(spec, request):
                pruned += 1
                continue
            for grad_sync in space.grad_sync:
                requests += 1
                plan, why = _try_memo(tried, base, spec.name, request, grad_sync, env)
                if plan is None and grad_sync != "naive" and "grad_sync" in why:
                    plan, _ = _try_memo(tried, base, spec.name, request, "naive", env)
                if plan is None:
                    refused[why] += 1
                    continue
                why = shape_rule(shape, plan)
                if why:
                    refused[_reason(why)] += 1
                    continue
                candidate = _candidate(spec.name, plan, request)
                key = _key(candidate)
                kept = seen.get(key)
                if kept is None or _preferred(candidate) < _preferred(kept):
                    seen[key] = candidate
    return Enumeration(list(seen.values()), refused, requests, pruned)


def _try_memo(tried: dict, base: dict, name: str, request: dict, grad_sync: str, env: LaunchEnv):
    """build_plan's answer, asked once per request without its recompute mode: every check of
    build_plan but its recompute check (`_check_recompute`, which reads only the mode and the strategy)
    reads the same fields for every mode, so the modes share its answer, and a plan accepted for one
    mode is the same plan, its `recompute` replaced, for each mode the strategy takes."""
    key = _memo_key(request, grad_sync)
    if key not in tried and request.get("tp_saves", "gathered") != "gathered":
        # A sharded request differs from its gathered twin, asked just before it, only in check_tp_saves,
        # whose clauses but the schedule's `_tp_saves` has passed: a twin refused is this request refused
        # by the same rule (for a zero-bubble schedule build_plan might name tp_saves' clause instead; the
        # count is the same), and only the twins accepted are built again, where build_plan checks the rest.
        twin = tried.get(_memo_key({k: v for k, v in request.items() if k != "tp_saves"}, grad_sync))
        if twin is not None and twin[0] is None:
            tried[key] = twin
    if key not in tried:
        tried[key] = _try(base, name, {**request, "recompute": "none"} if "recompute" in request else request,
                          grad_sync, env)
    plan, why = tried[key]
    mode = request.get("recompute")
    if plan is None or mode is None or mode == plan.recompute:
        return plan, why
    try:
        _check_recompute(mode, plan.strategy, plan.spec)
    except ConfigError as e:
        return None, _reason(str(e))
    return replace(plan, recompute=mode), ""


def _memo_key(request: dict, grad_sync: str) -> tuple:
    return grad_sync, tuple(sorted((k, str(v)) for k, v in request.items() if k != "recompute"))


def _try(base: dict, name: str, request: dict, grad_sync: str, env: LaunchEnv) -> tuple[RunPlan | None, str]:
    try:
        return build_plan(_config(base, name, request, grad_sync), env, cuda_available=False), ""
    except (ConfigError, LayoutError) as e:
        return None, _reason(str(e))


def _reason(message: str) -> str:
    """A refusal's message with its numbers blanked, so that refusals count by rule, not by value."""
    import re

    return re.sub(r"\d+", "N", message.split(":")[0])[:160]


def _candidate(requested: str, plan: RunPlan, request: dict) -> Candidate:
    spec = plan.spec
    zero = zero_stage(plan.strategy, plan)
    grad_sync = plan.grad_sync if spec.grad_sync and plan.dims.dp > 1 and not zero else None
    return Candidate(requested, plan, zero, grad_sync, request)


@lru_cache(maxsize=4096)
def schedule_identity(schedule: str, p: int, m: int, v: int) -> int:
    """The identity of the action lists a schedule gives (interleaved with one chunk is 1F1B's)."""
    return hash(built_schedule(schedule, p, m, v))


def _preferred(c: Candidate) -> tuple:
    """Of several strategies that run one layout (dp over 4 ranks is `dp`, and also `pp` or `3d` with
    one stage), the one whose registry entry splits along the fewest dimensions: the most specific;
    then a request that names the strategy that runs (zero1 rather than dp with parallel.zero=1)."""
    return (len(c.plan.spec.dims), c.requested != c.plan.strategy)


def _key(c: Candidate) -> tuple:
    """Requests that run the same layout are one candidate (whichever strategy runs it: `_preferred`),
    and so are two schedule names that give the same action lists."""
    layout = c.layout
    schedule = None
    if c.plan.spec.pipelined and layout.dims.pp > 1:
        schedule = schedule_identity(layout.schedule, layout.dims.pp, layout.microbatches, layout.virtual_stages)
    return (layout.dims, layout.microbatches, layout.microbatch_size, layout.sequence_parallel, layout.tp_saves,
            layout.pp_layers, c.zero, c.grad_sync, schedule, c.request.get("recompute"))
