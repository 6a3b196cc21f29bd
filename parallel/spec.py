"""The registry's record: what the rest of the project knows about a strategy, declared once.

A `StrategySpec` is a plain record. The training loop builds the strategy from it (`build`),
plan.py checks a layout against it (the layout fields, then the entry's own `check`), the summary
compares a run with its closed forms (`comm`, `model_state`, `local_parameters`, `activations`:
functions on the model and the `Layout`), and the comparison pairs it with its PyTorch
counterpart (`counterpart`). Nothing else branches on a strategy's name.

Each family declares its records in its own __init__.py (`ENTRIES`); parallel/registry.py gathers
them into one table, and parallel/compose/route.py says which record runs a requested layout.
This file holds no table: only the record, the options a layout rule reads, and the error a
configuration value that cannot run ends in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from parallel.core.model import GPTConfig
from parallel.layout import Layout


class ConfigError(ValueError):
    """A configuration value that cannot run."""


@dataclass(frozen=True)
class Options:
    """The layout options a strategy's rules look at (the rest of the config is checked elsewhere)."""

    sequence_parallel: bool = False
    zero: int = 0
    cp_kind: str = "ring"  # the attention across cp ranks; the requested spec's `cp_kind` sets it


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
    # -- layout rules (checked by registry.check_layout, before any process group) --
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
    zero_dp: bool = False  # parallel.zero sets the ZeRO stage of its dp dimension (parallel/compose/route.py)
    recompute: bool = False  # train.recompute (selective | full) applies: parallel/core/recompute.py's transform
    tp_saves: bool = False  # parallel.tp_saves=sharded applies: its column-parallel linears can keep the sequence piece
    cp_kind: str | None = None  # context parallelism: the attention it asks for ("ring" | "a2a"), wherever it runs
    checkpoints: bool = True  # train.checkpoint_every / train.resume
    exposed_comm_measured: bool = True  # false where it waits inside PyTorch, out of the log's sight
    counterpart: str | None = None  # PyTorch's implementation of the same idea, for the comparison's ratio
    tags: frozenset = field(default_factory=frozenset)  # "baseline" for PyTorch's own, "sharded" for ZeRO-like
