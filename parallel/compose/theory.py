"""dp x cp x tp x pp on one mesh: the closed forms of every rank, stage by stage (docs/combined.md).

What a rank of pipeline stage r holds and sends: its blocks (the schedule's placement gives them),
cut over tp, with the embedding on the stage holding the first virtual stage and the head on the
one holding the last; the families' own formulas (parallel/tp/theory.py, parallel/pp/theory.py,
parallel/cp/theory.py) applied to those blocks only. Like every theory file, independent of the
code it checks: counts from the GPT formula, bytes from the formulas, not from the log.
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
from parallel.pp.schedules import schedule_placement
from parallel.pp.split import layer_counts
from parallel.pp.theory import p2p_sent_by_rank
from parallel.tp.theory import saves_sequence_piece, tp_tensors_per_layer


# -- what each stage holds ------------------------------------------------------------------------------
def stage_part_counts(cfg: GPTConfig, t: int, layers: int, first: bool, last: bool) -> list[int]:
    """The parts (ZeRO's unit of sharding: embedding, each Block, head) of one rank of a pipeline
    stage, each cut over t tp ranks: `layers` blocks of `algebra.tp_layer_parameter_count`, plus the token
    rows and positions on the first stage and the final norm and head rows on the last
    (parallel/model_state.py's `rank_parts`)."""
    refuse_moe(cfg, "pipeline stage counts")
    return rank_parts(ModelShape(gpt=cfg), range(layers), first, last, t)


def stage_shard_parameter_count(cfg: GPTConfig, t: int, layers: int, first: bool, last: bool) -> int:
    """The parameters one rank of a pipeline stage holds, its blocks cut over t tp ranks: the sum of
    its `stage_part_counts`. Summed over the stages it is Ψ_t."""
    return sum(stage_part_counts(cfg, t, layers, first, last))


def stage_blocks(cfg: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                 schedule: str = "1f1b") -> list[list[int]]:
    """The blocks (by index) each pipeline rank holds: those of its v chunks, the virtual stages the
    schedule's placement gives it (r, r + p, r + 2p, ... on the loop; r and 2p-1-r on the V)."""
    spans = _vstage_spans(cfg, dims, virtual, pp_layers, schedule)
    return [_held_blocks(*spans, r) for r in range(dims.pp)]


def rank_blocks(cfg: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                schedule: str = "1f1b") -> list[int]:
    """The blocks of pipeline rank `pp_rank` alone (`stage_blocks`' row): the planner asks it of every
    stage of thousands of layouts, and building every rank's row to read one costs p times as much."""
    return _held_blocks(*_vstage_spans(cfg, dims, virtual, pp_layers, schedule), pp_rank)


def _vstage_spans(cfg: GPTConfig, dims: ParallelDims, virtual: int, pp_layers, schedule: str):
    """Each virtual stage's block count and first block, and the schedule's placement."""
    counts = layer_counts(cfg.n_layers, dims.pp * virtual, list(pp_layers) if pp_layers is not None else None)
    return counts, list(accumulate(counts, initial=0)), schedule_placement(schedule, dims.pp, virtual)


def _held_blocks(counts: list[int], starts: list[int], placement, pp_rank: int) -> list[int]:
    return [i for vs in placement.vstages_of(pp_rank) for i in range(starts[vs], starts[vs] + counts[vs])]


def stage_layers(cfg: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                 schedule: str = "1f1b") -> list[int]:
    """How many blocks each pipeline rank holds (`stage_blocks`)."""
    return [len(blocks) for blocks in stage_blocks(cfg, dims, virtual, pp_layers, schedule)]


def stage_ends(dims: ParallelDims, virtual: int = 1, schedule: str = "1f1b") -> list[tuple[bool, bool]]:
    """Per pipeline rank: whether it holds the first virtual stage (the embedding) and the last
    (the final norm, the head and the loss). On the loop rank 0 and rank p-1; on the V rank 0 both."""
    return [rank_ends(dims, r, virtual, schedule) for r in range(dims.pp)]


def rank_ends(dims: ParallelDims, pp_rank: int, virtual: int = 1, schedule: str = "1f1b") -> tuple[bool, bool]:
    """`stage_ends`' entry of pipeline rank `pp_rank` alone."""
    placement = schedule_placement(schedule, dims.pp, virtual)
    held = placement.vstages_of(pp_rank)
    return 0 in held, placement.vstages - 1 in held


def stage_parts(cfg: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                schedule: str = "1f1b") -> list[int]:
    """The parts one rank of stage `pp_rank` holds: its blocks and ends, each cut over tp."""
    refuse_moe(cfg, "pipeline stage counts")
    first, last = rank_ends(dims, pp_rank, virtual, schedule)
    return rank_parts(ModelShape(gpt=cfg), rank_blocks(cfg, dims, pp_rank, virtual, pp_layers, schedule),
                      first, last, dims.tp)


def stage_zero_padded_count(cfg: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                            schedule: str = "1f1b") -> int:
    """Ψ_pad of one rank of stage `pp_rank` under ZeRO over dp: each of its local parts padded to a
    multiple of d = dims.dp (what its reduce-scatters, all-gathers and shards are made of); under
    context parallelism the parameters are replicated over dp x cp and ZeRO shards over d·cp ranks."""
    n = replica_group_size(dims)
    return sum(padded(count, n) for count in stage_parts(cfg, dims, pp_rank, virtual, pp_layers, schedule))


def mesh3d_local_parameter_count(cfg: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                                 pp_rank: int = 0, schedule: str = "1f1b") -> int:
    """What one rank of stage `pp_rank` holds: its blocks and ends, cut over tp."""
    return sum(stage_parts(cfg, dims, pp_rank, virtual, pp_layers, schedule))


def mesh3d_first_stage_parameter_count(cfg: GPTConfig, layout: Layout) -> int:
    """What rank 0 (the first stage's tp rank 0) holds under dp x tp x pp."""
    return mesh3d_local_parameter_count(cfg, layout.dims, layout.virtual_stages, layout.pp_layers,
                                        schedule=layout.schedule)


def mesh3d_model_state_bytes(cfg: GPTConfig, dims: ParallelDims, pp_rank: int, zero: int = 0, virtual: int = 1,
                             pp_layers=None, dtype_bytes: int = FP32_BYTES, schedule: str = "1f1b") -> dict:
    """What one rank of stage `pp_rank` holds under dp x tp x pp: plain dp the stage's tp shard Ψ_r
    in full (4 + 4 + 8 bytes per parameter); ZeRO-1 over dp 1/d of its Adam state, ZeRO-2 also 1/d
    of its gradients, on the padded Ψ_pad,r (`stage_zero_padded_count`); d·cp under context parallelism.
    parallel/model_state.py's `model_state` of the rank's `stage_parts`."""
    parts = stage_parts(cfg, dims, pp_rank, virtual, pp_layers, schedule)
    return model_state(parts, run_state_bytes(dtype_bytes), zero, replica_group_size(dims))


def mesh3d_first_stage_model_state_bytes(cfg: GPTConfig, layout: Layout) -> dict | None:
    """dp x tp x pp: with one pipeline stage every rank holds the same (`mesh3d_model_state_bytes`);
    with several the stages differ, and the summary's one formula is None (per stage, call that)."""
    if layout.dims.pp != 1:
        return None
    return mesh3d_model_state_bytes(cfg, layout.dims, 0, layout.zero, layout.virtual_stages, layout.pp_layers,
                                    layout.dtype_bytes, layout.schedule)


# -- what each stage sends ------------------------------------------------------------------------------
def mesh3d_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """dp x tp x pp (with a plain or ZeRO dp dimension): every rank's traffic, stage by stage, then
    summed over the d·t ranks of each.

    A rank of stage r holding L_r blocks (over all its chunks) sends per step, with t = tp, d = dp:

      tp   the Megatron collectives of *its* blocks only: 4·L_r tensors of b·s·h per microbatch,
           plus the embedding's one on the first stage and the head's one on the last; the
           vocab-parallel loss's 3 all-reduces of b·s fp32 on the last stage. Each all-reduce
           2(t-1)/t of its bytes, or under sequence parallelism an all-gather plus a reduce-scatter,
           (t-1)/t each; then once per step the stage's sequence-sharded gradients (its blocks'
           6h, the positions s·h on the first stage, the final norm 2h on the last), all-reduced;
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
    With parallel.tp_saves=sharded each stage all-gathers, per microbatch, 2 more tensors of b·s·h per
    block and one for the head (the column-parallel inputs, gathered again in backward).
    """
    dims, b, m, B = layout.dims, layout.microbatch_size, layout.microbatches, layout.dtype_bytes
    virtual, pp_layers, zero = layout.virtual_stages, layout.pp_layers, layout.zero
    t, c, p = dims.tp, dims.cp, dims.pp
    d = replica_group_size(dims)  # the dp sum: over dp, or dp x cp
    s, h = cfg.seq_len // c, cfg.d_model  # the tokens of a sequence this rank holds
    activation = b * s * h * B
    boundary = b * (s // t if layout.sequence_parallel else s) * h * B
    schedule = layout.schedule
    layers = stage_layers(cfg, dims, virtual, pp_layers, schedule)
    ends = stage_ends(dims, virtual, schedule)
    pp_sent = p2p_sent_by_rank(schedule, p, m, virtual, boundary)
    per_layer = tp_tensors_per_layer(layout.recompute)
    ops = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv", "all_to_all")
    totals = {op: [0, Fraction(0)] for op in ops}
    dp_group = "dp_cp" if c > 1 else "dp"
    groups = {g: Fraction(0) for g in ("tp", "cp", "pp", dp_group)}
    per_rank_by_stage = []
    for r in range(p):
        first, last = ends[r]
        ar_payload, ag_payload = 0, 0  # this rank's per step
        if t > 1:
            acts = (per_layer * layers[r] + first + last) * m * activation
            loss = 3 * m * b * s * FP32_BYTES if last else 0
            if layout.sequence_parallel:
                ag_payload = acts
                ar_payload = loss + (6 * h * layers[r] + cfg.seq_len * h * first + 2 * h * last) * B
            else:
                ar_payload = acts + loss
        # parallel.tp_saves=sharded: each region's input all-gathered again in backward (attention and MLP in
        # every block of the stage, the head on the last), as tp.theory's `tp_regathers_per_microbatch` counts.
        regather = (2 * layers[r] + last) * m * activation if t > 1 and saves_sequence_piece(layout) else 0
        tp_sent = (all_reduce_sent_per_rank(t, ar_payload) + 2 * gather_or_scatter_sent_per_rank(t, ag_payload)
                   + gather_or_scatter_sent_per_rank(t, regather))
        p2p_payload = pp_sent[r]
        dp_payload = stage_shard_parameter_count(cfg, t, layers[r], first, last) * B if d > 1 and not zero else 0
        dp_sent = all_reduce_sent_per_rank(d, dp_payload)
        zero_gather = zero_scatter = 0  # ZeRO's payloads over dp
        if zero and d > 1:
            padded_bytes = stage_zero_padded_count(cfg, dims, r, virtual, pp_layers, schedule) * B
            zero_gather, zero_scatter = padded_bytes, (m if zero == 2 else 1) * padded_bytes
            dp_sent = gather_or_scatter_sent_per_rank(d, zero_gather + zero_scatter)
        ranks = d * t  # the ranks of this stage, all alike
        cp_ops = cp_attention_traffic(cfg, layout, layers[r])
        cp_sent = sum((sent for _, sent in cp_ops.values()), Fraction(0))
        for op, (payload, sent) in cp_ops.items():
            totals[op][0] += payload * ranks
            totals[op][1] += sent * ranks
        for op, payload, sent in (("all_reduce", ar_payload + dp_payload, all_reduce_sent_per_rank(t, ar_payload)
                                   + all_reduce_sent_per_rank(d, dp_payload)),
                                  ("all_gather", ag_payload + regather + zero_gather,
                                   gather_or_scatter_sent_per_rank(t, ag_payload + regather)
                                   + gather_or_scatter_sent_per_rank(d, zero_gather)),
                                  ("reduce_scatter", ag_payload + zero_scatter,
                                   gather_or_scatter_sent_per_rank(t, ag_payload)
                                   + gather_or_scatter_sent_per_rank(d, zero_scatter)),
                                  ("send", p2p_payload, Fraction(p2p_payload)), ("recv", p2p_payload, Fraction(0))):
            totals[op][0] += payload * ranks
            totals[op][1] += sent * ranks
        for g, v in (("tp", tp_sent), ("cp", cp_sent), ("pp", Fraction(p2p_payload)), (dp_group, dp_sent)):
            groups[g] += v * ranks
        per_rank_by_stage.append(tp_sent + cp_sent + p2p_payload + dp_sent)
    extra = {
        # What each rank of stage r sends per step (the stages differ: embedding, head, loss).
        "sent_bytes_per_rank_by_stage": [float(v) for v in per_rank_by_stage],
        "sent_bytes_per_rank_by_stage_exact": [str(v) for v in per_rank_by_stage],
        "layers_by_stage": layers,
        "boundary_bytes": boundary,
    }
    return figure({op: (pl, st) for op, (pl, st) in totals.items() if pl}, dims.world_size, groups, extra)
