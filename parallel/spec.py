"""The registry's record: what the rest of the project knows about a strategy, declared once.

A `StrategySpec` is a plain record. The training loop builds the strategy from it (`build`),
the run validator checks a layout against it (the layout fields, then the entry's own `check`), the summary
compares a run with its closed forms (`comm`, `model_state`, `local_parameters`, `activations`:
functions on the model and the `Layout`), and the comparison pairs it with its PyTorch
counterpart (`counterpart`). Nothing else branches on a strategy's name.

Each family declares its records in its own __init__.py (`ENTRIES`); parallel/registry.py gathers
them into one table, and parallel/compose/route.py says which record runs a requested layout.
This file holds no table: only the record and the error a configuration value that cannot run
ends in. Which families' options an entry honours is its `honours` (parallel/family.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache

from parallel.core.model import GPTConfig
from parallel.layout import Layout


class ConfigError(ValueError):
    """A configuration value that cannot run."""


@dataclass(frozen=True)
class StrategySpec:
    name: str
    description: str  # one line, for --help and the docs
    build: Callable  # (model, plan, ctx) -> Strategy: the model is the full GPT, built from the seed on every rank
    comm: Callable[[GPTConfig, Layout], dict]  # theory: traffic per step, all ranks, the summary's expected_comm
    model_state: Callable[[GPTConfig, Layout], dict | None] = lambda model, layout: None  # theory: bytes per rank
    local_parameters: Callable[[GPTConfig, Layout], int | None] = lambda model, layout: None  # what rank 0 holds
    # theory: bytes saved for backward at the step's peak, per rank (a list, rank order), or None
    activations: Callable[[GPTConfig, Layout], list[int] | None] = lambda model, layout: None
    # -- layout rules (checked by registry.check_layout, before any process group) --
    dims: frozenset = frozenset({"dp"})  # dimensions that may exceed 1
    min_world: int = 1
    max_world: int | None = None
    check: Callable | None = None  # (dims) -> None, raising LayoutError/ConfigError: rules of its own
    check_model: Callable | None = None  # (GPTConfig, dims) -> None, raising: its rules that need the model
    # -- the families whose options it honours (parallel/family.py) --
    # family -> the fields of its options record this entry honours. A family named with no fields
    # still cuts the model (torch_tp: tp's cut, not its options); one not named is not this entry's.
    honours: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # family -> option values this entry sets wherever it runs (cp_a2a: the all-to-all attention)
    sets: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    # (schedule, pp, microbatches, virtual) -> None, raising ScheduleError: a pipelined entry's own
    # rule on top of the schedule's (PyTorch's pipelining refuses some (p, m) that ours runs)
    schedule_check: Callable | None = None
    # -- mixture of experts (model.moe_experts > 0) --
    moe: bool = False  # trains MoE models: the balancing loss in its loss, every expert's gradient summed right
    moe_refusal: str = ""  # where moe is False: why, for the error line
    # -- a head tied to the token table (model.tied_head: one Parameter in embed.tok and head.out) --
    tied_head: bool = False  # trains it: keeps the shared Parameter whole, in one place, its gradient summed
    tied_head_refusal: str = ""  # where tied_head is False: why, for the error line
    # -- what it supports --
    recompute: bool = False  # train.recompute (selective | full) applies: parallel/core/recompute.py's transform
    checkpoints: bool = True  # train.checkpoint_every / train.resume
    # train.optimizer=sgd: it builds its optimizer with strategy.plan_optimizer (ZeRO's shard AdamW,
    # FSDP2's and the pipelines' optimizers are AdamW only, and refused it)
    sgd: bool = False
    exposed_comm_measured: bool = True  # false where it waits inside PyTorch, out of the log's sight
    counterpart: str | None = None  # PyTorch's implementation of the same idea, for the comparison's ratio
    tags: frozenset = field(default_factory=frozenset)  # "baseline" for PyTorch's own, "sharded" for ZeRO-like

    def uses(self, family: type) -> bool:
        """Whether this entry is cut by the family whose options class is `family` (TPOptions: tp),
        with or without its options."""
        return family.FAMILY in self.honours

    def honours_option(self, family: type, name: str) -> bool:
        """Whether this entry takes option `name` of the family whose options class is `family`; a
        name the class does not have is refused, so that a misspelt option never reads as `False`."""
        if name not in option_names(family):
            raise ValueError(f"{family.__name__} has no option {name!r}: "
                             f"choose one of {', '.join(option_names(family))}")
        return name in self.honours.get(family.FAMILY, ())


@cache
def option_names(family: type) -> tuple[str, ...]:
    """The fields of a family's options class."""
    return tuple(f.name for f in fields(family))
