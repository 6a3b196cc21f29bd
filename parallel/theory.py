"""Closed-form figures every run is checked against (derived, with sources, in docs/theory/).

Deliberately independent of the code it checks: parameter counts come from the GPT formula, not
from summing the model's tensors, and bytes from the per-strategy formulas, not from the
communication log's per-call arithmetic. Bytes are exact Fractions so that a test can assert
equality to the byte.
"""

from __future__ import annotations

from fractions import Fraction

from parallel.core.model import GPTConfig
from parallel.cp.traffic import local_kv_elements, ring_layer_traffic, ulysses_layer_traffic
from parallel.dist.dims import ParallelDims
from parallel.layout import Layout
from parallel.pp.schedules import schedule_placement
from parallel.pp.split import layer_counts
from parallel.pp.traffic import p2p_bytes_per_step, p2p_sent_by_rank

FP32_BYTES = 4


def parameter_count(cfg: GPTConfig) -> int:
    """Ψ = V·h + s·h + L·(12h² + 13h) + 2h + V·h (untied head), V the padded vocabulary,
    plus L_moe·[(E-1)·(8h² + 5h) + h·E] with experts.

    Per layer: Q, K, V and output projections 4h² + 4h, MLP 8h² + 5h (fc with bias 4h, proj with
    bias h), two LayerNorms 4h. The final LayerNorm adds 2h; the untied head V·h (no bias).
    Each of the L_moe MoE blocks holds E MLPs instead of one, and a router of h·E (no bias).
    """
    V, h, s, L = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers
    # The formula assumes the MLP is 4h wide; a different ratio changes the 12h² + 13h term.
    mlp = 2 * cfg.mlp_ratio * h * h + cfg.mlp_ratio * h + h
    per_layer = 4 * h * h + 4 * h + mlp + 4 * h
    return V * h + s * h + L * per_layer + 2 * h + V * h + len(cfg.moe_blocks) * moe_extra_parameters(cfg)


def tp_shard_parameter_count(cfg: GPTConfig, t: int) -> int:
    """Ψ_t, the parameters one tensor-parallel rank holds (Ψ_1 = Ψ), f = mlp_ratio·h the MLP width:

        V·h/t (token rows) + s·h (positions, replicated) + 2h (final norm) + V·h/t (head rows)
        + L·[ 4h (two norms) + 3(h² + h)/t (Q, K, V: columns and their bias)
              + h²/t + h (output projection: its input columns, the full bias)
              + (f·h + f)/t (fc: columns and bias) + f·h/t + h (proj: input columns, full bias) ]
    """
    if cfg.moe_experts:
        if t == 1:
            return parameter_count(cfg)
        _refuse_moe(cfg, "tensor-parallel shard counts")
    V, h, s, L, f = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers, cfg.d_ff
    per_layer = 4 * h + 3 * (h * h + h) // t + h * h // t + h + (f * h + f) // t + f * h // t + h
    return V * h // t + s * h + L * per_layer + 2 * h + V * h // t


def sequence_sharded_parameter_count(cfg: GPTConfig) -> int:
    """Replicated parameters whose gradient is partial under sequence parallelism: per layer two
    LayerNorms (4h) and two row-parallel biases (2h, added after the reduce-scatter), the final
    LayerNorm (2h) and the position table (s·h, each rank adds only its piece's positions)."""
    _refuse_moe(cfg, "sequence-parallel parameter counts")
    h, s, L = cfg.d_model, cfg.seq_len, cfg.n_layers
    return L * 6 * h + 2 * h + s * h


def part_parameter_counts(cfg: GPTConfig) -> list[int]:
    """Parameters of each part of the GPT, in forward order: the embedding V·h + s·h, each Block
    12h² + 13h (for an MLP 4h wide; an MoE block (E-1)·(8h² + 5h) + h·E more), the head 2h + V·h
    (final LayerNorm and the untied LM head)."""
    V, h, s, L = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers
    f = cfg.mlp_ratio * h
    block = 4 * h * h + 4 * h + 2 * f * h + f + h + 4 * h
    blocks = [block + (moe_extra_parameters(cfg) if cfg.is_moe_block(i) else 0) for i in range(L)]
    return [V * h + s * h, *blocks, 2 * h + V * h]


def zero_padded_parameter_count(cfg: GPTConfig, n: int) -> int:
    """Ψ_pad: ZeRO shards each part's flat buffer, padded to a multiple of the dp size n, so the
    bytes it moves and holds are computed on Σ_parts ceil(Ψ_part / n)·n (Ψ_pad = Ψ for n = 1)."""
    return sum(-(-count // n) * n for count in part_parameter_counts(cfg))


def replicated_model_state_bytes(cfg: GPTConfig, layout: Layout) -> dict:
    """Plain data parallelism (and one process) holds all of it on every rank: fp32 parameters 4Ψ,
    gradients 4Ψ and Adam's two moments 8Ψ bytes (ZeRO paper §5, with K = 8 for fp32 Adam)."""
    psi = parameter_count(cfg)
    B = layout.dtype_bytes
    return _state_figures(psi * B, psi * B, 2 * psi * B, psi)


def zero_model_state_bytes(cfg: GPTConfig, layout: Layout, stage: int) -> dict:
    """ZeRO over the N dp ranks (Rajbhandari et al. 2019, §5): stage 1 shards Adam's state, stage 2
    also the gradients, stage 3 also the parameters, each on the padded count Ψ_pad:

        zero1  4Ψ + 4Ψ + 8Ψ/N     zero2  4Ψ + 4Ψ/N + 8Ψ/N     zero3  (4Ψ + 4Ψ + 8Ψ)/N   (Ψ = Ψ_pad)
    """
    n, B = layout.dims.dp, layout.dtype_bytes
    psi = zero_padded_parameter_count(cfg, n)
    state = Fraction(2 * psi * B, n)
    grads = Fraction(psi * B, n) if stage >= 2 else psi * B
    params = Fraction(psi * B, n) if stage >= 3 else psi * B
    assert all(Fraction(v).denominator == 1 for v in (params, grads, state))  # Ψ_pad divides by n
    return _state_figures(int(params), int(grads), int(state), psi)


def _state_figures(params: int, grads: int, state: int, counted: int) -> dict:
    figures = {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state}
    return {**figures, "total_bytes": params + grads + state, "parameters_counted": counted}


def mesh3d_first_stage_model_state_bytes(cfg: GPTConfig, layout: Layout) -> dict | None:
    """dp x tp x pp: with one pipeline stage every rank holds the same (`mesh3d_model_state_bytes`);
    with several the stages differ, and the summary's one formula is None (per stage, call that)."""
    if layout.dims.pp != 1:
        return None
    return mesh3d_model_state_bytes(cfg, layout.dims, 0, layout.zero, layout.virtual_stages, layout.pp_layers,
                                    layout.dtype_bytes, layout.schedule)


def all_reduce_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    return Fraction(2 * (n - 1), n) * payload_bytes if n > 1 else Fraction(0)


def gather_or_scatter_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    return Fraction(n - 1, n) * payload_bytes


def _figure(totals_by_op: dict[str, tuple[int, Fraction]], ranks: int, extra: dict | None = None) -> dict:
    """(payload, sent) per op summed over all ranks -> the summary's expected_comm block."""
    by_op = {
        op: {"payload_bytes": payload, "sent_bytes": float(sent), "sent_bytes_exact": str(sent)}
        for op, (payload, sent) in totals_by_op.items()
    }
    total = sum((sent for _, sent in totals_by_op.values()), Fraction(0))
    return {
        "sent_bytes_per_step": float(total),
        "sent_bytes_per_step_exact": str(total),
        "sent_bytes_per_rank_per_step": float(total / ranks),  # the mean, where ranks differ
        "by_op": by_op,
        **(extra or {}),
    }


def pipeline_p2p_bytes(model_cfg: GPTConfig, microbatch_size: int, microbatches: int, stages: int, virtual: int,
                       dtype_bytes: int = FP32_BYTES) -> int:
    """Narayanan §3.2: b·s·h·B per microbatch per stage boundary in each direction, so
    2·m·(v·p-1)·b·s·h·B per step for one pipeline (v = 1 for GPipe and 1F1B)."""
    activation = microbatch_size * model_cfg.seq_len * model_cfg.d_model * dtype_bytes
    return 2 * microbatches * (virtual * stages - 1) * activation


def _tp_comm(cfg: GPTConfig, dims: ParallelDims, b: int, m: int, sequence_parallel: bool, B: int,
             recompute: str = "none") -> dict:
    """Tensor parallelism (with sequence parallelism, and data parallelism across tp groups).

    Per microbatch, every activation collective moves one tensor of b·s·h elements (the full
    sequence; under sequence parallelism the payload of an all-gather is its full output and of
    a reduce-scatter its full input, the same b·s·h):

      embedding      forward: the partial token embeddings summed                 1
      each layer     forward: attention and MLP outputs summed (row-parallel)     2
                     backward: the input gradients of attention and MLP summed    2
                     (Q/K/V and fc are column-parallel: each rank holds part of it)
      head           backward: the input gradient of the vocab-parallel head     1

    4L + 2 tensors of b·s·h per microbatch. Without sequence parallelism each is one all-reduce
    (2(t-1)/t of its bytes sent per rank): per layer 8·b·s·h·(t-1)/t elements (docs/theory/tensor-parallel.md).
    With it, each all-reduce is an all-gather plus a reduce-scatter ((t-1)/t each, the same bytes;
    the embedding and the head become a reduce-scatter forward + all-gather backward and an
    all-gather forward + reduce-scatter backward). The vocab-parallel cross-entropy adds three
    all-reduces of b·s fp32 values (row max, sum of exponentials, target logit). Once per step,
    sequence parallelism all-reduces the gradients of the sequence-sharded replicated parameters
    over tp, and data parallelism all-reduces every local gradient (Ψ_t of them) over dp.

    Under full recomputation (train.recompute=full) each block's forward runs again in backward,
    its two forward collectives with it: 6 tensors per layer instead of 4, 12·b·s·h·(t-1)/t
    elements sent per rank per layer instead of 8 (`tp_tensors_per_layer`). Selective
    recomputation re-runs only the attention core, which under tensor parallelism sends nothing.
    """
    t, d = dims.tp, dims.dp
    activation = b * cfg.seq_len * cfg.d_model * B
    activations = (tp_tensors_per_layer(recompute) * cfg.n_layers + 2) * m * activation  # all such tensors of one step
    loss = 3 * m * b * cfg.seq_len * FP32_BYTES
    by_op: dict[str, tuple[int, Fraction]] = {}
    tp_reduced = loss  # bytes all-reduced over tp
    if sequence_parallel:
        by_op["all_gather"] = by_op["reduce_scatter"] = (activations, gather_or_scatter_sent_per_rank(t, activations))
        tp_reduced += sequence_sharded_parameter_count(cfg) * B
        per_layer = {"all_gather": 2, "reduce_scatter": 2}
    else:
        tp_reduced += activations
        per_layer = {"all_reduce": 2}
    counts = {"fwd": per_layer, "bwd": per_layer}
    if recompute == "full":  # the forward's collectives once more, in backward (tagged `tp/<part>/fwd` too)
        counts["recompute"] = per_layer
    tp_sent = all_reduce_sent_per_rank(t, tp_reduced) + 2 * by_op.get("all_gather", (0, Fraction(0)))[1]
    dp_grads = tp_shard_parameter_count(cfg, t) * B if d > 1 else 0
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    by_op["all_reduce"] = (tp_reduced + dp_grads, all_reduce_sent_per_rank(t, tp_reduced) + dp_sent)
    ranks = dims.world_size
    totals = {op: (payload * ranks, sent * ranks) for op, (payload, sent) in by_op.items()}
    extra = {
        "by_group": {g: {"sent_bytes": float(v * ranks), "sent_bytes_exact": str(v * ranks)}
                     for g, v in (("tp", tp_sent), ("dp", dp_sent)) if v},
        # The Megatron count a run's comm.by_tag_op shows for every block, per rank.
        "per_layer_per_microbatch": counts,
        "activation_bytes": activation,
    }
    return _figure(totals, ranks, extra)


def _torch_tp_comm(cfg: GPTConfig, dims: ParallelDims, b: int, m: int, B: int) -> dict:
    """PyTorch DTensor tensor parallelism with parallel/baselines/dtensor_tp.py's plan (not Megatron's count).

    Per microbatch, with A = b·s·h·B the bytes of one activation:

      embedding   forward: the vocabulary-sharded lookups summed (RowwiseParallel)       1 all-reduce
      each layer  forward: attention and MLP outputs summed (RowwiseParallel)            2 all-reduces
                  backward: the input gradients of q, k, v and fc, each a ColwiseParallel
                  whose Replicate input gets its own Partial gradient                      4 all-reduces
      head        forward: the full logits all-gathered (output_layouts=Replicate())      b·s·V·B
                  backward: its input gradient summed                                     1 all-reduce

    so (6L + 2)·A all-reduced over tp against Megatron's (4L + 2)·A, and b·s·V·B gathered where
    Megatron's vocab-parallel loss all-reduces 3·b·s fp32 values. With dp > 1 the local shards
    (Ψ_t, the same as Megatron's) are summed over dp.
    """
    t, d = dims.tp, dims.dp
    activation = b * cfg.seq_len * cfg.d_model * B
    reduced = (6 * cfg.n_layers + 2) * m * activation
    logits = m * b * cfg.seq_len * cfg.padded_vocab_size * B
    dp_grads = tp_shard_parameter_count(cfg, t) * B if d > 1 else 0
    tp_sent = all_reduce_sent_per_rank(t, reduced) + gather_or_scatter_sent_per_rank(t, logits)
    dp_sent = all_reduce_sent_per_rank(d, dp_grads)
    ranks = dims.world_size
    by_op = {
        "all_reduce": (reduced + dp_grads, all_reduce_sent_per_rank(t, reduced) + dp_sent),
        "all_gather": (logits, gather_or_scatter_sent_per_rank(t, logits)),
    }
    totals = {op: (payload * ranks, sent * ranks) for op, (payload, sent) in by_op.items()}
    extra = {"by_group": {g: {"sent_bytes": float(v * ranks), "sent_bytes_exact": str(v * ranks)}
                          for g, v in (("tp", tp_sent), ("dp", dp_sent)) if v},
             "activation_bytes": activation}
    return _figure(totals, ranks, extra)


def stage_shard_parameter_count(cfg: GPTConfig, t: int, layers: int, first: bool, last: bool) -> int:
    """The parameters one rank of a pipeline stage holds, its blocks cut over t tp ranks: `layers`
    blocks as in `tp_shard_parameter_count`, plus the token rows and positions on the first stage
    and the final norm and head rows on the last. Summed over the stages it is Ψ_t."""
    _refuse_moe(cfg, "pipeline stage counts")
    V, h, s, f = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.d_ff
    per_layer = 4 * h + 3 * (h * h + h) // t + h * h // t + h + (f * h + f) // t + f * h // t + h
    return layers * per_layer + (V * h // t + s * h if first else 0) + (2 * h + V * h // t if last else 0)


def stage_layers(cfg: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                 schedule: str = "1f1b") -> list[int]:
    """Blocks each pipeline rank holds: its v chunks, the virtual stages the schedule's placement
    gives it (r, r + p, r + 2p, ... on the loop; r and 2p-1-r on the V)."""
    counts = layer_counts(cfg.n_layers, dims.pp * virtual, list(pp_layers) if pp_layers is not None else None)
    placement = schedule_placement(schedule, dims.pp, virtual)
    return [sum(counts[vs] for vs in placement.vstages_of(r)) for r in range(dims.pp)]


def stage_ends(dims: ParallelDims, virtual: int = 1, schedule: str = "1f1b") -> list[tuple[bool, bool]]:
    """Per pipeline rank: whether it holds the first virtual stage (the embedding) and the last
    (the final norm, the head and the loss). On the loop rank 0 and rank p-1; on the V rank 0 both."""
    placement = schedule_placement(schedule, dims.pp, virtual)
    last = placement.vstages - 1
    return [(0 in placement.vstages_of(r), last in placement.vstages_of(r)) for r in range(dims.pp)]


def stage_part_counts(cfg: GPTConfig, t: int, layers: int, first: bool, last: bool) -> list[int]:
    """The parts (ZeRO's unit of sharding: embedding, each Block, head) of one rank of a pipeline
    stage, each cut over t tp ranks as in `stage_shard_parameter_count`, whose sum they are."""
    _refuse_moe(cfg, "pipeline stage counts")
    V, h, s, f = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.d_ff
    per_layer = 4 * h + 3 * (h * h + h) // t + h * h // t + h + (f * h + f) // t + f * h // t + h
    return [*([V * h // t + s * h] if first else []), *[per_layer] * layers, *([2 * h + V * h // t] if last else [])]


def stage_zero_padded_count(cfg: GPTConfig, dims: ParallelDims, pp_rank: int, virtual: int = 1, pp_layers=None,
                            schedule: str = "1f1b") -> int:
    """Ψ_pad of one rank of stage `pp_rank` under ZeRO over dp: each of its local parts padded to a
    multiple of d = dims.dp (what its reduce-scatters, all-gathers and shards are made of); under
    context parallelism the parameters are replicated over dp x cp and ZeRO shards over d·cp ranks."""
    layers = stage_layers(cfg, dims, virtual, pp_layers, schedule)[pp_rank]
    parts = stage_part_counts(cfg, dims.tp, layers, *stage_ends(dims, virtual, schedule)[pp_rank])
    n = replica_group_size(dims)
    return sum(-(-count // n) * n for count in parts)


def mesh3d_model_state_bytes(cfg: GPTConfig, dims: ParallelDims, pp_rank: int, zero: int = 0, virtual: int = 1,
                             pp_layers=None, dtype_bytes: int = FP32_BYTES, schedule: str = "1f1b") -> dict:
    """What one rank of stage `pp_rank` holds under dp x tp x pp: plain dp the stage's tp shard Ψ_r
    in full (4 + 4 + 8 bytes per parameter); ZeRO-1 over dp 1/d of its Adam state, ZeRO-2 also 1/d
    of its gradients, on the padded Ψ_pad,r (`stage_zero_padded_count`); d·cp under context parallelism."""
    d = replica_group_size(dims)
    if zero:
        psi = stage_zero_padded_count(cfg, dims, pp_rank, virtual, pp_layers, schedule)
        params, grads, state = (psi * dtype_bytes, psi * dtype_bytes // (d if zero >= 2 else 1),
                                2 * psi * dtype_bytes // d)
    else:
        layers = stage_layers(cfg, dims, virtual, pp_layers, schedule)[pp_rank]
        psi = stage_shard_parameter_count(cfg, dims.tp, layers, *stage_ends(dims, virtual, schedule)[pp_rank])
        params, grads, state = psi * dtype_bytes, psi * dtype_bytes, 2 * psi * dtype_bytes
    figures = {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state}
    return {**figures, "total_bytes": sum(figures.values()), "parameters_counted": psi}


def mesh3d_local_parameter_count(cfg: GPTConfig, dims: ParallelDims, virtual: int = 1, pp_layers=None,
                                 pp_rank: int = 0, schedule: str = "1f1b") -> int:
    layers = stage_layers(cfg, dims, virtual, pp_layers, schedule)[pp_rank]
    return stage_shard_parameter_count(cfg, dims.tp, layers, *stage_ends(dims, virtual, schedule)[pp_rank])


def _mesh3d_comm(cfg: GPTConfig, dims: ParallelDims, b: int, m: int, virtual: int, pp_layers,
                 sequence_parallel: bool, B: int, zero: int = 0, layout: Layout | None = None) -> dict:
    """dp x tp x pp: every rank's traffic, stage by stage, then summed over the d·t ranks of each.

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
           placement (parallel/pp/traffic.py's `p2p_sent_by_rank`);
      dp   one all-reduce of its own gradients, the stage's tp shard: 2(d-1)/d · Ψ_{r,t}·B;
           under ZeRO (zero = 1 or 2) its parts padded to multiples of d, Ψ_pad,r: the gradients
           reduce-scattered once per step (ZeRO-1) or once per microbatch (ZeRO-2), the updated
           parameters all-gathered once, (d-1)/d of each: (d-1)/d · (1 or m + 1) · Ψ_pad,r·B.

    Summed over stages, the tp and dp parts equal those of `tp` at the same d and t (the stages
    partition the layers); pp adds 2·m·crossings·b·s·h·B per pipeline (/t under sequence
    parallelism), d·t pipelines, crossings = v·p-1 on the loop and 2(p-1) on the V. "The first
    stage" and "the last" are the ranks holding the first and last virtual stages: on the V both
    are rank 0.

    With context parallelism (c = cp > 1; `layout` gives its kind and the recomputation) every rank
    holds s/c tokens of each sequence: every tp collective, the loss's and the pipeline boundary
    move b·(s/c)·h (the sequence-sharded parameters are still whole: s·h positions); the dp sum is
    over the d·c ranks that replicate the stage's parameters (group "dp_cp"); and each of the
    stage's blocks adds its attention's cp traffic (`cp_attention_traffic`, heads a/t). Under full
    recomputation each block's tp tensors are 6 per microbatch instead of 4 (`tp_tensors_per_layer`).
    """
    layout = layout if layout is not None else Layout(dims=dims)
    t, c, p = dims.tp, dims.cp, dims.pp
    d = replica_group_size(dims)  # the dp sum: over dp, or dp x cp
    s, h = cfg.seq_len // c, cfg.d_model  # the tokens of a sequence this rank holds
    activation = b * s * h * B
    boundary = b * (s // t if sequence_parallel else s) * h * B
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
            if sequence_parallel:
                ag_payload = acts
                ar_payload = loss + (6 * h * layers[r] + cfg.seq_len * h * first + 2 * h * last) * B
            else:
                ar_payload = acts + loss
        tp_sent = all_reduce_sent_per_rank(t, ar_payload) + 2 * gather_or_scatter_sent_per_rank(t, ag_payload)
        p2p_payload = pp_sent[r]
        dp_payload = stage_shard_parameter_count(cfg, t, layers[r], first, last) * B if d > 1 and not zero else 0
        dp_sent = all_reduce_sent_per_rank(d, dp_payload)
        zero_gather = zero_scatter = 0  # ZeRO's payloads over dp
        if zero and d > 1:
            padded = stage_zero_padded_count(cfg, dims, r, virtual, pp_layers, schedule) * B
            zero_gather, zero_scatter = padded, (m if zero == 2 else 1) * padded
            dp_sent = gather_or_scatter_sent_per_rank(d, zero_gather + zero_scatter)
        ranks = d * t  # the ranks of this stage, all alike
        cp_ops = cp_attention_traffic(cfg, layout, layers[r])
        cp_sent = sum((sent for _, sent in cp_ops.values()), Fraction(0))
        for op, (payload, sent) in cp_ops.items():
            totals[op][0] += payload * ranks
            totals[op][1] += sent * ranks
        for op, payload, sent in (("all_reduce", ar_payload + dp_payload, all_reduce_sent_per_rank(t, ar_payload)
                                   + all_reduce_sent_per_rank(d, dp_payload)),
                                  ("all_gather", ag_payload + zero_gather,
                                   gather_or_scatter_sent_per_rank(t, ag_payload)
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
        "by_group": {g: {"sent_bytes": float(v), "sent_bytes_exact": str(v)} for g, v in groups.items() if v},
        # What each rank of stage r sends per step (the stages differ: embedding, head, loss).
        "sent_bytes_per_rank_by_stage": [float(v) for v in per_rank_by_stage],
        "sent_bytes_per_rank_by_stage_exact": [str(v) for v in per_rank_by_stage],
        "layers_by_stage": layers,
        "boundary_bytes": boundary,
    }
    return _figure({op: (pl, st) for op, (pl, st) in totals.items() if pl}, dims.world_size, extra)

def _zero_comm(stage: int, cfg: GPTConfig, dims: ParallelDims, m: int, B: int) -> dict:
    """ZeRO over N = dp ranks (Rajbhandari et al. §7), on the padded flat buffers (Ψ_pad·B bytes
    of gradients G and of parameters P); a reduce-scatter or all-gather of S bytes sends
    (N-1)/N·S per rank:

      zero1   G reduce-scattered once per step, P all-gathered after the step: (N-1)/N·(G + P)
      zero2   each microbatch's G reduce-scattered as its parts finish backward, P all-gathered
              after the step: (N-1)/N·(m·G + P); with m = 1 the paper's (N-1)/N·(G + P)
      zero3   per microbatch, P all-gathered before forward and again before backward, G
              reduce-scattered: m·(N-1)/N·(2P + G)
    """
    n = dims.dp
    size = zero_padded_parameter_count(cfg, n) * B
    gathers, scatters = {1: (1, 1), 2: (1, m), 3: (2 * m, m)}[stage]
    per_rank = {"all_gather": gathers * size, "reduce_scatter": scatters * size}
    ranks = dims.world_size
    totals = {op: (payload * ranks, gather_or_scatter_sent_per_rank(n, payload) * ranks)
              for op, payload in per_rank.items()}
    return _figure(totals, ranks, {"padded_parameters": zero_padded_parameter_count(cfg, n)})


def fsdp2_group_padded_counts(cfg: GPTConfig, n: int) -> dict[str, int]:
    """Elements FSDP2 all-gathers and reduce-scatters per parameter group (torch 2.13,
    _fully_shard/_fsdp_param.py): every parameter is cut along dim 0 into n chunks of ceil(d0/n)
    rows, each padded to that size, so a parameter of shape (d0, ...) moves n·ceil(d0/n)·(rest)
    elements. Groups: each Block, and the root (embedding and head). An MoE block holds E MLPs
    and its router (E, h) instead of one MLP."""
    V, h, s, f = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.mlp_ratio * cfg.d_model

    def padded(d0: int, rest: int = 1) -> int:
        return n * -(-d0 // n) * rest

    attention = (4 * padded(h)                      # ln1, ln2 weight and bias
                 + 4 * (padded(h, h) + padded(h)))  # q, k, v, attention proj
    mlp = padded(f, h) + padded(f) + padded(h, f) + padded(h)  # fc, proj
    moe_mlp = padded(cfg.moe_experts, h) + cfg.moe_experts * mlp  # router, experts
    blocks = {f"blocks.{i}": attention + (moe_mlp if cfg.is_moe_block(i) else mlp) for i in range(cfg.n_layers)}
    root = padded(V, h) + padded(s, h) + 2 * padded(h) + padded(V, h)
    return {**blocks, "root": root}


def _fsdp2_comm(cfg: GPTConfig, dims: ParallelDims, m: int, B: int) -> dict:
    """torch_fsdp2 (fully_shard per Block and on the root), per microbatch: each Block's group
    all-gathered before forward and again before backward, the root's once (FSDP2 keeps the root
    unsharded between its forward and backward), every group's gradients reduce-scattered once:
    (N-1)/N·(2·P_blocks + P_root + G) per rank and microbatch, on FSDP2's padded sizes."""
    n = dims.dp
    groups = fsdp2_group_padded_counts(cfg, n)
    blocks = sum(v for k, v in groups.items() if k != "root") * B
    root = groups["root"] * B
    per_rank = {"all_gather": m * (2 * blocks + root), "reduce_scatter": m * (blocks + root)}
    ranks = dims.world_size
    totals = {op: (payload * ranks, gather_or_scatter_sent_per_rank(n, payload) * ranks)
              for op, payload in per_rank.items()}
    return _figure(totals, ranks, {"padded_parameters": sum(groups.values())})


# -- each strategy's traffic per optimizer step, summed over all ranks (the registry names which) --
def no_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """One process: nothing crosses between ranks."""
    return _figure({}, layout.dims.world_size)


def dp_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """dp (naive, bucketed), torch_ddp, accelerate_ddp: one all-reduce of all gradients per step,
    2(N-1)/N · Ψ·B per rank, whatever the bucketing and however many microbatches are accumulated."""
    dims, grads = layout.dims, parameter_count(cfg) * layout.dtype_bytes
    return _figure({"all_reduce": (grads * dims.world_size,
                                   all_reduce_sent_per_rank(dims.dp, grads) * dims.world_size)},
                   dims.world_size)


def pipeline_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """pp and torch_pp (torch's stages send the same activations and gradients): every activation
    and its gradient crosses each boundary between ranks once per microbatch (sends; a receive sends
    nothing), 2·m·crossings·b·s·h·B per pipeline with the schedule's placement's crossings (v·p-1 on
    the loop, 2(p-1) on the V: parallel/pp/traffic.py), in each of the dp pipelines; with dp > 1
    each stage then all-reduces its own parameters over dp, which sums to 2(dp-1)/dp · Ψ·B per
    pipeline rank position, i.e. 2(dp-1) · Ψ·B over all ranks."""
    dims, B = layout.dims, layout.dtype_bytes
    boundary = layout.microbatch_size * cfg.seq_len * cfg.d_model * B
    p2p = p2p_bytes_per_step(layout.schedule, dims.pp, layout.microbatches, layout.virtual_stages, boundary) * dims.dp
    totals = {"send": (p2p, Fraction(p2p)), "recv": (p2p, Fraction(0))} if p2p else {}
    if dims.dp > 1:
        grads = parameter_count(cfg) * B  # summed over the stages of one pipeline
        totals["all_reduce"] = (grads * dims.dp, all_reduce_sent_per_rank(dims.dp, grads) * dims.dp)
    return _figure(totals, dims.world_size)


def tp_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """tp and tp_sp (with dp across tp groups): see `_tp_comm`."""
    return _tp_comm(cfg, layout.dims, layout.microbatch_size, layout.microbatches, layout.sequence_parallel,
                    layout.dtype_bytes, layout.recompute)


def torch_tp_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """torch_tp (DTensor): see `_torch_tp_comm`."""
    return _torch_tp_comm(cfg, layout.dims, layout.microbatch_size, layout.microbatches, layout.dtype_bytes)


def mesh3d_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """dp x tp x pp with a plain or ZeRO dp dimension: see `_mesh3d_comm`."""
    return _mesh3d_comm(cfg, layout.dims, layout.microbatch_size, layout.microbatches, layout.virtual_stages,
                        layout.pp_layers, layout.sequence_parallel, layout.dtype_bytes, layout.zero, layout)


def zero_comm(cfg: GPTConfig, layout: Layout, stage: int) -> dict:
    """zero1, zero2, zero3: see `_zero_comm`."""
    return _zero_comm(stage, cfg, layout.dims, layout.microbatches, layout.dtype_bytes)


def fsdp2_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """torch_fsdp2: see `_fsdp2_comm`."""
    return _fsdp2_comm(cfg, layout.dims, layout.microbatches, layout.dtype_bytes)


def tp_local_parameter_count(cfg: GPTConfig, layout: Layout) -> int:
    """What rank 0 holds when the model is cut over tp only (Ψ_t; Ψ without tp)."""
    return tp_shard_parameter_count(cfg, layout.dims.tp)


def mesh3d_first_stage_parameter_count(cfg: GPTConfig, layout: Layout) -> int:
    """What rank 0 (the first stage's tp rank 0) holds under dp x tp x pp."""
    return mesh3d_local_parameter_count(cfg, layout.dims, layout.virtual_stages, layout.pp_layers,
                                        schedule=layout.schedule)


# -- mixture of experts ---------------------------------------------------------------------------
def _refuse_moe(cfg: GPTConfig, what: str) -> None:
    """Formulas written for the dense block only: say so rather than return a wrong count."""
    if cfg.moe_experts:
        raise ValueError(
            f"theory has no {what} for a mixture-of-experts model (model.moe_experts={cfg.moe_experts}): "
            "they are written for the dense block; use model.moe_experts=0"
        )


def moe_extra_parameters(cfg: GPTConfig) -> int:
    """What an MoE block holds beyond the dense block: (E-1) more MLPs of 2f·h + f + h (f = mlp_ratio·h)
    and the router's h·E weights (no bias, as in Switch)."""
    h, f, E = cfg.d_model, cfg.d_ff, cfg.moe_experts
    return (E - 1) * (2 * f * h + f + h) + h * E


def active_parameter_count(cfg: GPTConfig) -> int:
    """Parameters one token's forward multiplies by: Ψ less the E-k experts of each MoE block it does
    not go to, L_moe·(E-k)·(2f·h + f + h) (Ψ for a dense model). The FLOPs per token follow it."""
    if not cfg.moe_experts:
        return parameter_count(cfg)
    h, f = cfg.d_model, cfg.d_ff
    return parameter_count(cfg) - len(cfg.moe_blocks) * (cfg.moe_experts - cfg.moe_top_k) * (2 * f * h + f + h)


def ep_shard_parameter_count(cfg: GPTConfig, ep: int) -> int:
    """Parameters one expert-parallel rank holds: everything but the experts whole, and E/ep of each
    MoE block's experts: Ψ - L_moe·(E - E/ep)·(2f·h + f + h)."""
    h, f, E = cfg.d_model, cfg.d_ff, cfg.moe_experts
    return parameter_count(cfg) - len(cfg.moe_blocks) * (E - E // ep) * (2 * f * h + f + h)


# -- expert parallelism (parallel/moe/strategy.py; docs/theory/experts.md) ----------------------------
def expert_parameters(cfg: GPTConfig) -> int:
    """One expert: an MLP of the dense shape, 2f·h + f + h (fc h->f and proj f->h with their biases)."""
    h, f = cfg.d_model, cfg.d_ff
    return 2 * f * h + f + h


def ep_dense_parameter_count(cfg: GPTConfig) -> int:
    """What every dp rank holds whole under expert parallelism, and sums over all dp ranks: the model
    but its experts (the routers included), Ψ - L_moe·E·(2f·h + f + h)."""
    return parameter_count(cfg) - len(cfg.moe_blocks) * cfg.moe_experts * expert_parameters(cfg)


def ep_expert_parameter_count(cfg: GPTConfig, ep: int) -> int:
    """The experts one of `ep` expert-parallel ranks holds, summed over its edp group only:
    L_moe·(E/ep)·(2f·h + f + h)."""
    return len(cfg.moe_blocks) * (cfg.moe_experts // ep) * expert_parameters(cfg)


def ep_model_state_bytes(cfg: GPTConfig, layout: Layout) -> dict:
    """One expert-parallel rank's model state (every rank alike): its Ψ_ep parameters in fp32, their
    gradients, and Adam's two moments, 4Ψ_ep + 4Ψ_ep + 8Ψ_ep bytes, Ψ_ep = `ep_shard_parameter_count`."""
    psi = ep_shard_parameter_count(cfg, layout.dims.ep)
    B = layout.dtype_bytes
    return _state_figures(psi * B, psi * B, 2 * psi * B, psi)


def ep_local_parameter_count(cfg: GPTConfig, layout: Layout) -> int:
    """What rank 0 holds under expert parallelism: Ψ_ep."""
    return ep_shard_parameter_count(cfg, layout.dims.ep)


def ep_all_to_all_uniform_bytes(cfg: GPTConfig, layout: Layout) -> Fraction:
    """Bytes one expert-parallel rank sends per step in its all-to-alls under uniform routing with
    nothing dropped (the planner's figure; a run's exact one follows its routing, `ep_comm`):

        m · L_moe · [ 4 · (n-1)/n · T·k·h·B  +  (n-1)/n · E·8 ]      T = b·s tokens per microbatch
    """
    from parallel.moe.traffic import uniform_sent_per_rank

    tokens = layout.microbatch_size * cfg.seq_len
    return uniform_sent_per_rank(tokens, cfg.moe_top_k, cfg.d_model, cfg.moe_experts, layout.dims.ep,
                                 layout.dtype_bytes, len(cfg.moe_blocks), layout.microbatches)


def ep_all_to_all_pair_bytes_uniform(cfg: GPTConfig, layout: Layout) -> Fraction:
    """Bytes one expert-parallel rank sends to each one of the n-1 others per step under uniform
    routing, m · L_moe · [4·T·k/n·h·B + E/n·8]: what a planner puts on the link between two ep ranks
    (an intra-node or an inter-node one, by where it places them); (n-1) of these make
    `ep_all_to_all_uniform_bytes`."""
    n = layout.dims.ep
    return ep_all_to_all_uniform_bytes(cfg, layout) / (n - 1) if n > 1 else Fraction(0)


def ep_all_to_all_exact(cfg: GPTConfig, layout: Layout) -> tuple[int, Fraction]:
    """(payload, sent) of every rank's all-to-alls in the step whose routing the layout holds: per ep
    group and MoE call, the five calls of parallel/moe/traffic.py on that call's counts matrix."""
    from parallel.moe.traffic import layer_call_bytes

    payload, sent = 0, Fraction(0)
    for group in layout.dims.group_ranks("ep"):
        calls = {len(layout.routing[r]) for r in group}
        if len(calls) != 1:
            raise ValueError(f"the ranks of ep group {group} report different numbers of MoE calls: {sorted(calls)}")
        for call in range(calls.pop()):
            counts = [list(layout.routing[r][call]) for r in group]
            for rank_calls in layer_call_bytes(counts, cfg.d_model, layout.dtype_bytes):
                payload += sum(c.payload for c in rank_calls.values())
                sent += sum(c.sent for c in rank_calls.values())
    return payload, sent


def ep_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """Expert parallelism inside data parallelism (d = dp ranks, n = ep of them per expert group):

      dp   every rank all-reduces the gradients of the dense parts and routers, Ψ_dense·B, over dp:
           2(d-1)/d · Ψ_dense·B per rank
      edp  every rank all-reduces its experts' gradients, L_moe·(E/n)·(2f·h + f + h)·B, over the d/n
           ranks that hold the same experts: 2(d/n-1)/(d/n) of it per rank (nothing when d = n)
      ep   per MoE block and microbatch, the counts and four row all-to-alls: exactly what the
           routing in `layout.routing` sends (`ep_all_to_all_exact`), or, for a layout never run,
           the uniform-routing figure of `ep_all_to_all_uniform_bytes` (an expectation)

    `all_to_all` in the result says which (`routing`: "measured" or "uniform") and gives the uniform
    figure beside the exact one, summed over all ranks.
    """
    dims, B = layout.dims, layout.dtype_bytes
    d, n, ranks = dims.dp, dims.ep, dims.world_size
    dense = ep_dense_parameter_count(cfg) * B
    experts = ep_expert_parameter_count(cfg, n) * B
    dp_sent = all_reduce_sent_per_rank(d, dense) * ranks
    edp_sent = all_reduce_sent_per_rank(d // n, experts) * ranks
    uniform = ep_all_to_all_uniform_bytes(cfg, layout) * ranks
    tokens = layout.microbatch_size * cfg.seq_len
    if layout.routing is None:
        # Uniform routing: every call's input holds the counts and T·k rows (dispatch, combine, twice).
        per_call = cfg.moe_experts * 8 + 4 * tokens * cfg.moe_top_k * cfg.d_model * B
        a2a_payload, a2a_sent = per_call * len(cfg.moe_blocks) * layout.microbatches * ranks, uniform
    else:
        a2a_payload, a2a_sent = ep_all_to_all_exact(cfg, layout)
    totals = {"all_reduce": ((dense + (experts if d > n else 0)) * ranks, dp_sent + edp_sent),
              "all_to_all": (a2a_payload, a2a_sent)}
    groups = {"dp": dp_sent, "edp": edp_sent, "ep": a2a_sent}
    extra = {
        "by_group": {g: {"sent_bytes": float(v), "sent_bytes_exact": str(v)} for g, v in groups.items() if v},
        "all_to_all": {"routing": "uniform" if layout.routing is None else "measured",
                       "sent_bytes": float(a2a_sent), "sent_bytes_exact": str(a2a_sent),
                       "uniform_sent_bytes": float(uniform), "uniform_sent_bytes_exact": str(uniform)},
    }
    return _figure(totals, ranks, extra)


# -- context parallelism and activation recomputation (docs/theory/context.md, docs/theory/memory.md) --
ID_BYTES = 8  # token ids, targets and positions are int64


def replica_group_size(dims: ParallelDims) -> int:
    """The ranks that hold the same parameters and sum their gradients: dp, times cp when the
    sequence is split too (context parallelism replicates every weight over its cp ranks)."""
    return dims.dp * dims.cp


def tp_tensors_per_layer(recompute: str) -> int:
    """Activation tensors of b·s·h one block's tensor-parallel regions move per microbatch: 2 in
    forward (attention and MLP outputs summed), 2 in backward (their input gradients summed), and
    under full recomputation the forward's 2 again in backward: 4, or 6 (selective: 4, the core
    it re-runs has no tp collective)."""
    return 6 if recompute == "full" else 4


def activation_dtype_bytes(layout: Layout) -> int:
    """Bytes of the activations inside a block (q, k, v, attention outputs): 2 under bf16 autocast."""
    return 2 if layout.precision == "bf16" else layout.dtype_bytes


def cp_attention_traffic(cfg: GPTConfig, layout: Layout, layers: int) -> dict[str, tuple[int, Fraction]]:
    """What one rank's attention sends across its cp group per step, over `layers` blocks:
    {op: (payload bytes, sent bytes)}, empty without context parallelism.

    Per layer and microbatch (parallel/cp/traffic.py, docs/theory/context.md §2-3), with
    U = b·(a/t)·(s/cp)·d the elements of one of this rank's Q, K or V (a/t heads under tp):

      ring   forward (cp−1)·2U·B, backward (cp−1)·2U·(B + max(B, 4)): `send` calls (their `recv`
             twins carry the same payload and send nothing)
      a2a    forward and backward (cp−1)/cp·4U·B each: `all_to_all` calls, payload 4U·B each way

    Recomputation (selective or full) runs the core's forward once more inside backward, its
    sends with it: the forward's bytes count twice.
    """
    dims = layout.dims
    if dims.cp == 1:
        return {}
    b, m, B = layout.microbatch_size, layout.microbatches, activation_dtype_bytes(layout)
    heads, forwards = cfg.n_heads // dims.tp, 2 if layout.recompute != "none" else 1
    traffic = (ring_layer_traffic if layout.cp_kind == "ring" else ulysses_layer_traffic)(
        b, cfg.seq_len, heads, cfg.head_dim, dims.cp, B)
    sent = layers * m * (forwards * traffic.fwd_sent + traffic.bwd_sent)
    if traffic.op == "send":
        return {"send": (int(sent), sent), "recv": (int(sent), Fraction(0))}
    per_direction = 4 * local_kv_elements(b, cfg.seq_len, heads, cfg.head_dim, dims.cp) * B
    return {"all_to_all": (layers * m * (forwards + 1) * per_direction, sent)}


def cp_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """cp and cp_a2a (dp x cp, one stage, no tp): per step, every rank sends

      cp      its attention's bytes over all L layers (`cp_attention_traffic`), and
      dp_cp   its gradients summed over the n = dp·cp ranks that replicate every parameter:
              one all-reduce, 2(n−1)/n·Ψ·B; or ZeRO over those n ranks on Ψ_pad(n)·B bytes
              (G reduce-scattered once per step, or per microbatch under ZeRO-2, P all-gathered):
              (n−1)/n·(G + P) or (n−1)/n·(m·G + P), as `_zero_comm` with N = n.
    """
    dims, B, m = layout.dims, layout.dtype_bytes, layout.microbatches
    n, ranks = replica_group_size(dims), dims.world_size
    attention = cp_attention_traffic(cfg, layout, cfg.n_layers)
    if layout.zero:
        size = zero_padded_parameter_count(cfg, n) * B
        grads = {"all_gather": size, "reduce_scatter": (m if layout.zero == 2 else 1) * size}
        grad_ops = {op: (payload, gather_or_scatter_sent_per_rank(n, payload)) for op, payload in grads.items()}
    else:
        grads_bytes = parameter_count(cfg) * B
        grad_ops = {"all_reduce": (grads_bytes, all_reduce_sent_per_rank(n, grads_bytes))}
    per_rank = {**attention, **grad_ops}
    totals = {op: (payload * ranks, sent * ranks) for op, (payload, sent) in per_rank.items()}
    groups = {"cp": sum((sent for _, sent in attention.values()), Fraction(0)),
              "dp_cp": sum((sent for _, sent in grad_ops.values()), Fraction(0))}
    extra = {"by_group": {g: {"sent_bytes": float(v * ranks), "sent_bytes_exact": str(v * ranks)}
                          for g, v in groups.items() if v}}
    return _figure(totals, ranks, extra)


def cp_model_state_bytes(cfg: GPTConfig, layout: Layout) -> dict:
    """Every rank holds the whole model (16Ψ bytes in fp32 with Adam); with ZeRO-1/2 over the
    dp·cp ranks, `zero_model_state_bytes` with N = dp·cp."""
    if not layout.zero:
        return replicated_model_state_bytes(cfg, layout)
    n = replica_group_size(layout.dims)
    return zero_model_state_bytes(cfg, Layout(dims=ParallelDims(world_size=n, dp=n), dtype_bytes=layout.dtype_bytes),
                                  layout.zero)


def _attention_saved(cfg: GPTConfig, tokens: int, seq_len: int, kind: str) -> dict[str, int]:
    """Bytes one attention (fp32) saves for backward on `tokens` = T = b·(s/cp) tokens of a rank:

      qkv          what holds q, k, v: views of the three projections' outputs (sdpa, ring), or the
                   gathered q, k, v of the all-to-all (a2a: the projections' outputs are not kept), 3·T·h
      proj_input   the output projection's input, T·h: the core's output buffer itself (sdpa and
                   ring lay it out (b, s, a, d), so merging the heads is a view), or its copy (a2a)
      core_only    what only the core saves: the lse, T·a (sdpa, ring); the inner SDPA's output
                   and lse, T·(h + a), and the two int64 index tensors (2·s) that put the gathered
                   sequence in position order and back (a2a)
      recomputed   what the core saves when it runs again in backward under selective
                   recomputation: a new output and lse, T·(h + a), plus the gathered q, k, v (a2a)
    """
    h, a, B = cfg.d_model, cfg.n_heads, FP32_BYTES
    out_lse = tokens * (h + a) * B
    if kind == "a2a":
        core_only = out_lse + 2 * seq_len * ID_BYTES
        return {"qkv": 3 * tokens * h * B, "proj_input": tokens * h * B, "core_only": core_only,
                "recomputed": core_only + 3 * tokens * h * B}
    return {"qkv": 3 * tokens * h * B, "proj_input": tokens * h * B, "core_only": tokens * a * B, "recomputed": out_lse}


def activation_terms(cfg: GPTConfig, layout: Layout) -> dict | None:
    """The bytes saved for backward per rank, term by term, at the step's peak (docs/theory/memory.md).

    For this GPT's ops in fp32 without dropout, T = b·(s/cp) tokens of one microbatch on a rank,
    h, f = mlp_ratio·h, a heads, V the padded vocabulary, G = dp·m·b sequences in the global batch:

      embedding   the token ids (a view of the step's global batch: its storage, G·s int64; under
                  cp the rank's own copy, b·(s/cp)) and the positions (s/cp int64)
      each block  LayerNorms 2·(input + output + mean + rstd) = T·(4h + 4), q, k, v and the
                  attention core (`_attention_saved`), fc output and GELU output 2·T·f
      head        final LayerNorm T·(2h + 2), log-softmax T·V, the targets (as the ids), nll's
                  total weight (4 bytes)

    Peak per mode, L blocks: none E + L·layer + H; selective: each block's core keeps only its
    inputs (the larger of the forward's end and the last core's recomputation in backward); full:
    E + L·T·h + max(H, layer − T·h): only each block's input is kept, and after the head's backward
    the last block is recomputed whole (its input already counted). None where the model or layout
    is outside what is derived (dropout, experts, bf16, tensor or pipeline parallelism).
    """
    dims = layout.dims
    if cfg.dropout or cfg.moe_experts or layout.precision != "fp32" or dims.tp > 1 or dims.pp > 1:
        return None
    h, f, V, B, L = cfg.d_model, cfg.d_ff, cfg.padded_vocab_size, FP32_BYTES, cfg.n_layers
    b, cp = layout.microbatch_size, dims.cp
    s = cfg.seq_len // cp
    tokens = b * s
    ids = b * s * ID_BYTES if cp > 1 else dims.dp * layout.microbatches * b * cfg.seq_len * ID_BYTES
    attention = _attention_saved(cfg, tokens, cfg.seq_len, layout.cp_kind if cp > 1 else "sdpa")
    norms, mlp, block_input = tokens * (4 * h + 4) * B, 2 * tokens * f * B, tokens * h * B
    layer = norms + attention["qkv"] + attention["proj_input"] + attention["core_only"] + mlp
    embedding = ids + s * ID_BYTES
    head = tokens * (2 * h + 2 + V) * B + ids + FP32_BYTES
    if layout.recompute == "none":
        peak = embedding + L * layer + head
    elif layout.recompute == "selective":
        kept = layer - attention["core_only"]
        # In backward, the last block's core runs again while its first norm and q, k, v are still held.
        last_core = (L - 1) * kept + tokens * (2 * h + 2) * B + attention["qkv"] + attention["recomputed"]
        peak = embedding + max(L * kept + head, last_core)
    else:
        peak = embedding + L * block_input + max(head, layer - block_input)
    return {"embedding": embedding, "layer": layer, "head": head, "peak": peak}


def activation_bytes(cfg: GPTConfig, layout: Layout) -> list[int] | None:
    """The registry's `activations` formula for single, dp, zero1/2, cp and cp_a2a: every rank
    holds the same, `activation_terms(...)["peak"]`."""
    terms = activation_terms(cfg, layout)
    return None if terms is None else [terms["peak"]] * layout.dims.world_size
