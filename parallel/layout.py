"""How one optimizer step is split across ranks: everything the closed forms need besides the model.

A `Layout` is the part of a run's plan that decides traffic and memory: the dimensions (dp, tp, pp,
cp, ep), the microbatches, the precision and the recomputation every family shares, and each
family's own options (`options`: one record per family, declared in its folder's options.py, e.g.
parallel/tp/options.py). The closed forms (parallel/algebra.py, the families' theory.py) take
(GPTConfig, Layout); a run builds its Layout from the validated plan (`RunPlan.layout`), and a
planner builds one for a layout it never runs. A family reads its own record (`layout.of(TPOptions)`)
and never another family's: what several need to know about how a microbatch is cut (tp's sequence
pieces, cp's kind of attention) they read from `layout.cut()`, which each family's record fills in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar, runtime_checkable

from parallel.dist.dims import ParallelDims

FP32_BYTES = 4

Record = TypeVar("Record")


@dataclass(frozen=True)
class FamilyOptions:
    """Each family's options record, by family name (a record's class says its family: `FAMILY`).

    A family absent here runs with its defaults, which change nothing: `of(cls)` then gives `cls()`.
    Frozen and hashable, so a Layout can key the planner's caches."""

    records: tuple = ()

    @classmethod
    def of_records(cls, records: Iterable) -> FamilyOptions:
        by_family = {type(r).FAMILY: r for r in records}
        return cls(tuple(by_family[name] for name in sorted(by_family)))

    def of(self, cls: type[Record]) -> Record:
        return next((r for r in self.records if type(r).FAMILY == cls.FAMILY), None) or cls()

    def get(self, family: str):
        """The record of family `family`, or None where it runs with its defaults."""
        return next((r for r in self.records if type(r).FAMILY == family), None)

    def with_record(self, record) -> FamilyOptions:
        return FamilyOptions.of_records([*(r for r in self.records if type(r).FAMILY != type(record).FAMILY),
                                         record])

    def changed(self, family: str, **changes) -> FamilyOptions:
        """The same records with `changes` applied to family `family`'s (which must be present)."""
        return self.with_record(replace(self.get(family), **changes))


@dataclass(frozen=True)
class Cut:
    """How one rank's microbatch is cut: b sequences, each split over cp ranks (`cp_kind`: "ring" or
    "a2a"), the block over t tp ranks (with sequence parallelism or not), B bytes per activation;
    `saves_shard`: under sequence parallelism the column-parallel linears keep their input's piece
    of the sequence, not the all-gathered input. The families' records fill in their part
    (`CutsMicrobatch`); every family and formula reads it without knowing whose option it was."""

    b: int
    t: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_kind: str = "ring"
    act_bytes: int = 4
    saves_shard: bool = False

    @property
    def column_input_tokens(self) -> int:
        """Of each sequence of s_r tokens, how many a column-parallel linear's saved input holds: all
        of them (the gathered input), or this rank's piece s_r/t (`saves_shard`)."""
        return self.t if self.saves_shard else 1


@runtime_checkable
class CutsMicrobatch(Protocol):
    """A family's options record that changes how a microbatch is cut: it gives its fields of `Cut`."""

    def cut(self, dims: ParallelDims) -> dict:
        """The `Cut` fields this family's options set on a layout of these dimensions."""


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    microbatches: int = 1
    microbatch_size: int = 1  # sequences per microbatch on each dp rank
    dtype_bytes: int = FP32_BYTES  # of parameters, gradients and the activations that cross ranks
    # Mixture of experts: where the router sent the tokens, which sets expert parallelism's all-to-all
    # bytes. routing[rank][call][e]: kept assignments to expert e of each MoE call (block, microbatch,
    # in the order run) of the step, on every global rank, as measured in a run; None: a layout
    # never run, whose all-to-alls theory figures under uniform routing (parallel/moe/theory.py).
    routing: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    recompute: str = "none"  # train.recompute: none | selective (attention cores) | full (every Block)
    precision: str = "fp32"  # train.precision: under bf16 the activations that cross ranks inside a block are bf16
    options: FamilyOptions = FamilyOptions()  # each family's record (parallel/<family>/options.py)

    def of(self, cls: type[Record]) -> Record:
        """This layout's record of the family whose options class is `cls` (its defaults where unset)."""
        return self.options.of(cls)

    def rank_tokens(self, seq_len: int) -> int:
        """Tokens of one microbatch on one rank: its b sequences, each cut over the cp ranks to s/cp."""
        return self.microbatch_size * (seq_len // self.dims.cp)

    def cut(self, act_bytes: int = FP32_BYTES) -> Cut:
        """How each rank's microbatch is cut: the dimensions, then what each family's record says."""
        fields = {}
        for record in self.options.records:
            if isinstance(record, CutsMicrobatch):
                fields.update(record.cut(self.dims))
        return Cut(b=self.microbatch_size, t=self.dims.tp, cp=self.dims.cp, act_bytes=act_bytes, **fields)
