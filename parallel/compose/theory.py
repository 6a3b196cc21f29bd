"""dp x cp x tp x pp on one mesh: the closed forms of every rank, stage by stage (docs/combined.md).

What a rank of pipeline stage r holds and sends: its blocks (the schedule's placement gives them),
cut over tp, with the embedding on the stage holding the first virtual stage and the head on the
one holding the last; the families' own formulas (parallel/tp/theory.py, parallel/pp/theory.py,
parallel/cp/theory.py) applied to those blocks only. Like every theory file, independent of the
code it checks: counts from the GPT formula, bytes from the formulas, not from the log.

What each stage sends (`combined_comm`). A rank of stage r holding L_r blocks (over all its chunks)
sends per step, with t = tp, d = dp:

  tp   the Megatron collectives of *its* blocks only: 4·L_r tensors of b·s·h per microbatch,
       plus the embedding's one on the first stage and the head's one on the last; the
       vocab-parallel loss's 3 all-reduces of b·s fp32 on the last stage. Each all-reduce
       2(t-1)/t of its bytes, or under sequence parallelism an all-gather plus a reduce-scatter,
       (t-1)/t each; then once per step the stage's sequence-sharded gradients (its blocks'
       6h, the positions s·h on the first stage, the final norm 2h on the last), all-reduced
       (under ZeRO-2 once per microbatch: it reduce-scatters each microbatch's gradients over dp,
       and a shard of a sum over dp can only be completed over tp before);
  pp   one send of its boundary activation per microbatch for each chunk whose next virtual
       stage is on another rank, and one of the input gradient for each whose previous one
       is: b·s·h, or b·(s/t)·h under sequence parallelism (each tp rank sends its piece of the
       sequence); which stages a rank holds, and so which boundaries cross, is the schedule's
       placement (parallel/pp/theory.py's `p2p_sent_by_rank`);
  dp   one all-reduce of its own gradients, the stage's tp shard: 2(d-1)/d · Ψ_{r,t}·B;
       under ZeRO (zero = 1 or 2) its parts padded to multiples of d, Ψ_pad,r: the gradients
       reduce-scattered once per step (ZeRO-1) or once per microbatch (ZeRO-2), the updated
       parameters all-gathered once, (d-1)/d of each: (d-1)/d · (1 or m + 1) · Ψ_pad,r·B.

Summed over stages, the tp and dp parts equal those of `tp` at the same d and t (the stages
partition the layers); pp adds 2·m·crossings·b·s·h·B per pipeline (/t under sequence
parallelism), d·t pipelines, crossings = v·p-1 on the loop and 2(p-1) on the V. "The first
stage" and "the last" are the ranks holding the first and last virtual stages: on the V both
are rank 0.

With context parallelism (c = cp > 1; the layout gives its kind and the recomputation) every rank
holds s/c tokens of each sequence: every tp collective, the loss's and the pipeline boundary
move b·(s/c)·h (the sequence-sharded parameters are still whole: s·h positions); the dp sum is
over the d·c ranks that replicate the stage's parameters (group "dp_cp"); and each of the
stage's blocks adds its attention's cp traffic (`cp_attention_traffic`, heads a/t). Under full
recomputation each block's tp tensors are 6 per microbatch instead of 4 (`tp_tensors_per_layer`).
With the sequence piece saved each stage all-gathers, per microbatch, 2 more tensors of b·s·h per
block and one for the head (the column-parallel inputs, gathered again in backward). The tp part of
every stage is tensor parallelism's own per-stage term (`tp_stage_payloads`), the cp part context
parallelism's (`cp_attention_traffic`), the pp part the pipeline's (`p2p_sent_by_rank`): this
`combined_comm` only places them on the stages and adds the dp sync.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import accumulate

from parallel.algebra import (
    FP32_BYTES,
    all_reduce_sent_per_rank,
    figure,
    gather_or_scatter_sent_per_rank,
    padded,
    refuse_moe,
    replica_group_size,
)
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.cp.theory import cp_attention_traffic
from parallel.dist.dims import ParallelDims
from parallel.layout import Layout
from parallel.model_state import model_state, rank_parts, run_state_bytes
from parallel.pp.options import PPOptions
from parallel.pp.schedules import schedule_placement
from parallel.pp.split import layer_counts
from parallel.pp.theory import p2p_sent_by_rank, pipeline_walk, schedule_makespan, stage_layer_counts
from parallel.sync.options import SyncOptions
from parallel.tp.theory import tp_stage_payloads


# -- what each stage holds ------------------------------------------------------------------------------
def stage_part_counts(model: GPTConfig, t: int, layers: int, first: bool, last: bool) -> list[int]:
    """The parts (ZeRO's unit of sharding: embedding, each Block, head) of one rank of a pipeline
    stage, each cut over t tp ranks: `layers` blocks of `algebra.tp_layer_parameter_count`, plus the token
    rows and positions on the first stage and the final norm and head rows on the last
    (parallel/model_state.py's `rank_parts`)."""
    refuse_moe(model, "pipeline stage counts")
    return rank_parts(ModelShape(gpt=model), range(layers), first, last, t)


def stage_shard_parameter_count(model: GPTConfig, t: int, layers: int, first: bool, last: bool) -> int:
    """The parameters one rank of a pipeline stage holds, its blocks cut over t tp ranks: the sum of
    its `stage_part_counts`. Summed over the stages it is Ψ_t."""
    return sum(stage_part_counts(model, t, layers, first, last))


def stage_blocks(model: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                 schedule: str = "1f1b") -> list[list[int]]:
    """The blocks (by index) each pipeline rank holds: those of its v chunks, the virtual stages the
    schedule's placement gives it (r, r + p, r + 2p, ... on the loop; r and 2p-1-r on the V)."""
    spans = _vstage_spans(model, dims, virtual, pp_layers, schedule)
    return [_held_blocks(*spans, r) for r in range(dims.pp)]


def rank_blocks(model: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                schedule: str = "1f1b") -> list[int]:
    """The blocks of pipeline rank `pp_rank` alone (`stage_blocks`' row): the planner asks it of every
    stage of thousands of layouts, and building every rank's row to read one costs p times as much."""
    return _held_blocks(*_vstage_spans(model, dims, virtual, pp_layers, schedule), pp_rank)


def _vstage_spans(model: GPTConfig, dims: ParallelDims, virtual: int, pp_layers, schedule: str):
    """Each virtual stage's block count and first block, and the schedule's placement."""
    counts = layer_counts(model.n_layers, dims.pp * virtual, list(pp_layers) if pp_layers is not None else None)
    return counts, list(accumulate(counts, initial=0)), schedule_placement(schedule, dims.pp, virtual)


def _held_blocks(counts: list[int], starts: list[int], placement, pp_rank: int) -> list[int]:
    return [i for vs in placement.vstages_of(pp_rank) for i in range(starts[vs], starts[vs] + counts[vs])]


def stage_layers(model: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                 schedule: str = "1f1b") -> list[int]:
    """How many blocks each pipeline rank holds (`stage_blocks`)."""
    return [len(blocks) for blocks in stage_blocks(model, dims, virtual, pp_layers, schedule)]


def stage_ends(dims: ParallelDims, virtual: int = 1, schedule: str = "1f1b") -> list[tuple[bool, bool]]:
    """Per pipeline rank: whether it holds the first virtual stage (the embedding) and the last
    (the final norm, the head and the loss). On the loop rank 0 and rank p-1; on the V rank 0 both."""
    return [rank_ends(dims, r, virtual, schedule) for r in range(dims.pp)]


def rank_ends(dims: ParallelDims, pp_rank: int, virtual: int = 1, schedule: str = "1f1b") -> tuple[bool, bool]:
    """`stage_ends`' entry of pipeline rank `pp_rank` alone."""
    placement = schedule_placement(schedule, dims.pp, virtual)
    held = placement.vstages_of(pp_rank)
    return 0 in held, placement.vstages - 1 in held


def stage_parts(model: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                schedule: str = "1f1b") -> list[int]:
    """The parts one rank of stage `pp_rank` holds: its blocks and ends, each cut over tp."""
    refuse_moe(model, "pipeline stage counts")
    first, last = rank_ends(dims, pp_rank, virtual, schedule)
    return rank_parts(ModelShape(gpt=model), rank_blocks(model, dims, pp_rank, virtual, pp_layers, schedule),
                      first, last, dims.tp)


def stage_zero_padded_count(model: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                            schedule: str = "1f1b") -> int:
    """Ψ_pad of one rank of stage `pp_rank` under ZeRO over dp: each of its local parts padded to a
    multiple of d = dims.dp (what its reduce-scatters, all-gathers and shards are made of); under
    context parallelism the parameters are replicated over dp x cp and ZeRO shards over d·cp ranks."""
    n = replica_group_size(dims)
    return sum(padded(count, n) for count in stage_parts(model, dims, pp_rank, virtual, pp_layers, schedule))


def combined_local_parameter_count(model: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                                 pp_rank: int = 0, schedule: str = "1f1b") -> int:
    """What one rank of stage `pp_rank` holds: its blocks and ends, cut over tp."""
    return sum(stage_parts(model, dims, pp_rank, virtual, pp_layers, schedule))


def combined_first_stage_parameter_count(model: GPTConfig, layout: Layout) -> int:
    """What rank 0 (the first stage's tp rank 0) holds under dp x tp x pp."""
    pipeline = layout.of(PPOptions)
    return combined_local_parameter_count(model, layout.dims, pipeline.virtual_stages, pipeline.layers,
                                        schedule=pipeline.schedule)


def combined_model_state_bytes(model: GPTConfig, dims: ParallelDims, pp_rank: int, zero: int = 0, virtual: int = 1,
                             pp_layers=None, dtype_bytes: int = FP32_BYTES, schedule: str = "1f1b") -> dict:
    """What one rank of stage `pp_rank` holds under dp x tp x pp: plain dp the stage's tp shard Ψ_r
    in full (4 + 4 + 8 bytes per parameter); ZeRO-1 over dp 1/d of its Adam state, ZeRO-2 also 1/d
    of its gradients, on the padded Ψ_pad,r (`stage_zero_padded_count`); d·cp under context parallelism.
    parallel/model_state.py's `model_state` of the rank's `stage_parts`."""
    parts = stage_parts(model, dims, pp_rank, virtual, pp_layers, schedule)
    return model_state(parts, run_state_bytes(dtype_bytes), zero, replica_group_size(dims))


def combined_first_stage_model_state_bytes(model: GPTConfig, layout: Layout) -> dict | None:
    """dp x tp x pp: with one pipeline stage every rank holds the same (`combined_model_state_bytes`);
    with several the stages differ, and the summary's one formula is None (per stage, call that)."""
    if layout.dims.pp != 1:
        return None
    pipeline = layout.of(PPOptions)
    return combined_model_state_bytes(model, layout.dims, 0, layout.of(SyncOptions).zero, pipeline.virtual_stages,
                                    pipeline.layers, layout.dtype_bytes, pipeline.schedule)


# -- a layout's stages, for the planner (which reads no family's options) --------------------------------
def layers_by_stage(model: GPTConfig, layout: Layout) -> list[int]:
    """Blocks each pipeline rank holds over its chunks, by the schedule's placement (`stage_layers`)."""
    pipeline = layout.of(PPOptions)
    return stage_layers(model, layout.dims, pipeline.virtual_stages, pipeline.layers, pipeline.schedule)


def placement_by_stage(model: GPTConfig, layout: Layout) -> tuple[list[list[int]], list[tuple[bool, bool]]]:
    """Each pipeline rank's blocks and whether it holds the first and the last virtual stage."""
    pipeline = layout.of(PPOptions)
    return (stage_blocks(model, layout.dims, pipeline.virtual_stages, pipeline.layers, pipeline.schedule),
            stage_ends(layout.dims, pipeline.virtual_stages, pipeline.schedule))


def virtual_stage_layers(n_layers: int, layout: Layout) -> list[int]:
    """Blocks of each virtual stage (parallel/pp/theory.py's `stage_layer_counts`)."""
    return stage_layer_counts(n_layers, layout)


def schedule_walk(layout: Layout):
    """Each pipeline rank's forwards and backwards in its schedule's order, or None without a pipeline."""
    return pipeline_walk(layout)


def pipeline_makespan(layout: Layout, forward: float, backward: float, send: float) -> float:
    """The layout's schedule played with these per-microbatch costs (parallel/pp/theory.py); under full
    recomputation a split backward's W has nothing left to do."""
    pipeline, dims = layout.of(PPOptions), layout.dims
    return schedule_makespan(pipeline.schedule, dims.pp, layout.microbatches, pipeline.virtual_stages, forward,
                             backward, send, 0.0 if layout.recompute == "full" else 0.5)


def chunks_per_rank(layout: Layout) -> int:
    """Model chunks each pipeline rank holds (parallel.virtual_stages)."""
    return layout.of(PPOptions).virtual_stages


# -- what each stage sends ------------------------------------------------------------------------------
def combined_comm(model: GPTConfig, layout: Layout) -> dict:
    """dp x tp x pp (with a plain or ZeRO dp dimension): every rank's traffic, stage by stage, then
    summed over the d·t ranks of each. See the module's docstring for the terms
    of each stage, each a family's own formula placed on the stage.
    """
    dims, m, B = layout.dims, layout.microbatches, layout.dtype_bytes
    pipeline, zero = layout.of(PPOptions), layout.of(SyncOptions).zero
    d = replica_group_size(dims)  # the dp sum: over dp, or dp x cp
    boundary = layout.microbatch_size * (model.seq_len // dims.cp) * model.d_model * B
    if layout.cut().sequence_parallel:  # each tp rank sends its piece of the sequence
        boundary //= dims.tp
    layers = stage_layers(model, dims, pipeline.virtual_stages, pipeline.layers, pipeline.schedule)
    ends = stage_ends(dims, pipeline.virtual_stages, pipeline.schedule)
    pp_sent = p2p_sent_by_rank(pipeline.schedule, dims.pp, m, pipeline.virtual_stages, boundary)
    total = _Traffic(dp_group="dp_cp" if dims.cp > 1 else "dp")
    per_rank_by_stage = []
    for r in range(dims.pp):
        first, last = ends[r]
        stage = _Traffic(dp_group=total.dp_group)
        if dims.tp > 1:
            # ZeRO-2 completes every microbatch's partial gradients before it reduce-scatters them
            tp = tp_stage_payloads(model, layout, layers[r], first, last, m if zero == 2 and d > 1 else 1)
            stage.add("tp", dims.tp, all_reduce=tp.all_reduce, all_gather=tp.all_gather,
                      reduce_scatter=tp.reduce_scatter)
        for op, (payload, sent) in cp_attention_traffic(model, layout, layers[r]).items():
            stage.add_sent("cp", op, payload, sent)
        stage.add_sent("pp", "send", pp_sent[r], Fraction(pp_sent[r]))
        stage.add_sent("pp", "recv", pp_sent[r], Fraction(0))
        if d > 1 and zero:  # ZeRO over dp: the parts padded to multiples of d
            padded_bytes = stage_zero_padded_count(model, dims, r, pipeline.virtual_stages, pipeline.layers,
                                                   pipeline.schedule) * B
            stage.add(total.dp_group, d, all_gather=padded_bytes, reduce_scatter=(m if zero == 2 else 1) * padded_bytes)
        elif d > 1:
            grads = stage_shard_parameter_count(model, dims.tp, layers[r], first, last) * B
            stage.add(total.dp_group, d, all_reduce=grads)
        total.merge(stage, ranks=d * dims.tp)  # the ranks of this stage, all alike
        per_rank_by_stage.append(stage.sent())
    extra = {
        # What each rank of stage r sends per step (the stages differ: embedding, head, loss).
        "sent_bytes_per_rank_by_stage": [float(v) for v in per_rank_by_stage],
        "sent_bytes_per_rank_by_stage_exact": [str(v) for v in per_rank_by_stage],
        "layers_by_stage": layers,
        "boundary_bytes": boundary,
        # Each group's all-gathers (the planner times ZeRO's parameter gathers apart from its reductions).
        "all_gather_sent_by_group_exact": {g: str(v) for g, v in total.gathered.items() if v},
    }
    return figure(total.by_op(), dims.world_size, total.groups, extra)


OPS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv", "all_to_all")


class _Traffic:
    """(payload, sent) per op and sent per group, added up one collective at a time."""

    def __init__(self, dp_group: str):
        self.dp_group = dp_group
        self.ops = {op: [0, Fraction(0)] for op in OPS}
        self.groups = {g: Fraction(0) for g in ("tp", "cp", "pp", dp_group)}
        self.gathered = {g: Fraction(0) for g in self.groups}  # of each group's, the all-gathers

    def add_sent(self, group: str, op: str, payload: int, sent: Fraction) -> None:
        self.ops[op][0] += payload
        self.ops[op][1] += sent
        self.groups[group] += sent
        if op == "all_gather":
            self.gathered[group] += sent

    def add(self, group: str, size: int, all_reduce: int = 0, all_gather: int = 0, reduce_scatter: int = 0) -> None:
        """Collectives over a group of `size` ranks: 2(n-1)/n of an all-reduce's payload sent, (n-1)/n of the rest."""
        self.add_sent(group, "all_reduce", all_reduce, all_reduce_sent_per_rank(size, all_reduce))
        self.add_sent(group, "all_gather", all_gather, gather_or_scatter_sent_per_rank(size, all_gather))
        self.add_sent(group, "reduce_scatter", reduce_scatter, gather_or_scatter_sent_per_rank(size, reduce_scatter))

    def merge(self, other: _Traffic, ranks: int) -> None:
        for op, (payload, sent) in other.ops.items():
            self.ops[op][0] += payload * ranks
            self.ops[op][1] += sent * ranks
        for g, v in other.groups.items():
            self.groups[g] += v * ranks
        for g, v in other.gathered.items():
            self.gathered[g] += v * ranks

    def sent(self) -> Fraction:
        return sum(self.groups.values(), Fraction(0))

    def by_op(self) -> dict:
        return {op: (payload, sent) for op, (payload, sent) in self.ops.items() if payload}
