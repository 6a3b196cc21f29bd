"""A family declares itself once: its options, its refusals, what the planner may try, its summary.

A family is one way of splitting the step (tp, pp, cp; the dp dimension's sync, parallel/sync/),
a folder of parallel/ that reads as a chapter. Its `Family` record, in its __init__.py beside its
strategies (`ENTRIES`), is everything the run validator, the planner and the summary know of it:

    options    its record's class, in its options.py: a frozen dataclass, one field per option,
               each made with `option` (its default changes nothing, its config key, why it exists)
    rules      its refusals, given the whole request (`Check`): one line naming the value and the fix
    search     the records the planner tries on a layout (`Search`), from conf/plan.yaml's plan.search,
               and `fallback`: what to try instead of one the validator refused
    describe   its fields of the summary's and the planner's `parallel` block, and its words in a
               planner row's label; `identity`: what of its options changes the run (for the planner,
               two schedule names that give the same lists are one layout)
    report     its own block of summary.json, where it has one (the pipeline's bubble, the routing),
               and `measured`: what a run measured that its closed forms need (the routing)

A family without options (moe) declares only what it adds to the summary (`options` None).

Nothing outside a family's folder names its options: the validator parses every family's record
from `parallel.*` (`Family.parse`), runs every family's rules, and hands the records on inside the
`Layout`; the planner builds its requests as the product of the families' searches; the summary
merges their descriptions. Each family's refusals read its own options and the request's sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields

from parallel.core.model import GPTConfig
from parallel.dist.dims import ParallelDims
from parallel.layout import Layout
from parallel.spec import StrategySpec


def option(default, key: str | None = None, configurable: bool = True):
    """A field of a family's options record: its default (which changes nothing), its config key
    `parallel.<key>` (the field's own name where None), and whether a user sets it (`configurable`;
    otherwise the strategy that runs does, e.g. cp's kind of attention)."""
    return field(default=default, metadata={"key": key, "configurable": configurable})


def option_keys(cls: type, configurable_only: bool = False) -> dict[str, str]:
    """Each option's config key -> its field, for a family's record class (with `configurable_only`,
    only the options a user sets)."""
    return {(f.metadata.get("key") or f.name): f.name for f in fields(cls)
            if not configurable_only or f.metadata.get("configurable", True)}


@dataclass(frozen=True)
class Check:
    """What a family's rules see of a request: the model, the layout with every family's record, the
    entry that runs it and the one asked for (a preset that runs as another may still be refused
    for what it asked), and the backend whose rules its communication will run under."""

    model: GPTConfig
    layout: Layout
    spec: StrategySpec
    requested: StrategySpec
    entries: Mapping[str, StrategySpec] = field(default_factory=dict)  # the registry, for naming alternatives
    backend: str | None = None  # the run's: gloo or nccl (None: one process, or not known)
    # False: the pipeline's posting is not replayed here (the planner replays it for the rows that fit)
    replay_schedule: bool = True

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims


@dataclass(frozen=True)
class Search:
    """What a family's search sees: the entry, the layout's sizes, the model and conf/plan.yaml's
    `plan.search`, from which each family reads its own keys."""

    spec: StrategySpec
    dims: ParallelDims
    model: GPTConfig
    space: Mapping


@dataclass(frozen=True)
class Family:
    name: str
    options: type | None  # its record's class (`options.FAMILY == name`); None: a family with no options
    rules: Callable[[Check], None] | None = None
    search: Callable[[Search], Iterable] | None = None  # records to try, the default record first
    describe: Callable[[Layout, StrategySpec], dict] | None = None
    label: Callable[[dict], list[str]] | None = None  # its words in a planner row's short label, from `describe`'s
    # (layout, spec) -> what of its record changes the run, for telling layouts apart (None: the record)
    identity: Callable[[Layout, StrategySpec], object] | None = None
    # (record, the validator's refusal) -> the record to try instead, or None: the planner's second try
    fallback: Callable[[object, str], object | None] | None = None
    report: Callable | None = None  # (plan, rank_reports, run_dir) -> {block name: block} of summary.json
    measured: Callable | None = None  # (layout, rank_reports) -> the layout with what the run measured

    def __post_init__(self):
        if self.options is None:
            return
        if getattr(self.options, "FAMILY", None) != self.name:
            raise TypeError(f"family {self.name!r}: its options class must say FAMILY = {self.name!r}")
        for f in fields(self.options):
            if f.default is MISSING:
                raise TypeError(f"family {self.name!r}: option {f.name!r} has no default")

    def parse(self, section) -> object:
        """This family's record from the `parallel` config section (a DictConfig or a mapping): each
        configurable option's key where given, its default where not. The record checks its own values."""
        keys = option_keys(self.options, configurable_only=True)
        return self.options(**{name: section[key] for key, name in keys.items() if key in section})


def hydra_value(value) -> str:
    """A value as a Hydra command-line override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)
