"""The algebra every family's closed forms share, written once: byte sizes, the GPT's parameter
counts and their parts, padding, ring factors and the per-op/per-group figure a summary compares.

Each family's theory.py (parallel/dp/theory.py, parallel/tp/theory.py, ...) builds its traffic and
model state from these; derivations, with sources, in docs/theory/. Like every theory file, this
one is deliberately independent of the code it checks: parameter counts come from the GPT
formula, not from summing the model's tensors, and bytes from the per-strategy formulas, not from
the communication log's per-call arithmetic. Bytes are exact Fractions so that a test can assert
equality to the byte.
"""

from __future__ import annotations

from fractions import Fraction

from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.dist.dims import ParallelDims
from parallel.layout import FP32_BYTES as FP32_BYTES  # re-exported: fp32 parameters, gradients, losses
from parallel.layout import Layout

ID_BYTES = 8  # token ids, targets and positions are int64


def padded(count: int, n: int) -> int:
    """The smallest multiple of n that holds `count` elements: ceil(count / n)·n (ZeRO's and FSDP2's
    flat shards, whose n pieces are all the same size)."""
    return -(-count // n) * n


# -- parameter counts -------------------------------------------------------------------------------
def refuse_moe(model: GPTConfig, what: str) -> None:
    """Formulas written for the dense block only: say so rather than return a wrong count."""
    if model.moe_experts:
        raise ValueError(
            f"theory has no {what} for a mixture-of-experts model (model.moe_experts={model.moe_experts}): "
            "they are written for the dense block; use model.moe_experts=0"
        )


def expert_parameters(model: GPTConfig) -> int:
    """One expert: an MLP of the dense shape (`ModelShape.mlp_parameters`): 2f·h + f + h for GPT-2's
    (fc h->f and proj f->h with their biases), 3f·h for Llama's SwiGLU without biases."""
    return ModelShape(model).mlp_parameters()


def moe_extra_parameters(model: GPTConfig) -> int:
    """What an MoE block holds beyond the dense block: (E-1) more MLPs and the router's h·E weights
    (no bias, as in Switch)."""
    return (model.moe_experts - 1) * expert_parameters(model) + model.d_model * model.moe_experts


def parameter_count(model: GPTConfig) -> int:
    """Ψ: the embedding, L blocks, the final norm and the head (`ModelShape.parameter_count`), plus
    L_moe·[(E-1)·MLP + h·E] with experts.

    For GPT-2's block Ψ = V·h + s·h + L·(12h² + 13h) + 2h + V·h, V the padded vocabulary: per layer
    Q, K, V and output projections 4h² + 4h, MLP 8h² + 5h (fc with bias 4h, proj with bias h), two
    LayerNorms 4h; the final LayerNorm 2h, the untied head V·h (no bias). Llama's block (h_kv the
    K/V width, f the SwiGLU width, no biases, RMSNorm): 2h² + 2h·h_kv + 3h·f + 2h per layer, no
    position table, a final norm of h, and the head's V·h unless tied.
    """
    return ModelShape(model).parameter_count() + len(model.moe_blocks) * moe_extra_parameters(model)


def tp_layer_parameter_count(model: GPTConfig, t: int) -> int:
    """One dense block on one of t tensor-parallel ranks (`ModelShape.layer_parameters`); for GPT-2's
    block, f = mlp_ratio·h the MLP width:

        4h (two norms) + 3(h² + h)/t (Q, K, V: columns and their bias)
        + h²/t + h (output projection: its input columns, the full bias)
        + (f·h + f)/t (fc: columns and bias) + f·h/t + h (proj: input columns, full bias)
    """
    return ModelShape(model).layer_parameters(t)


def embedding_parameter_count(model: GPTConfig, t: int = 1) -> int:
    """The embedding on one of t tp ranks: token rows V·h/t (vocab-parallel) and, for learned
    positions, the table s·h (replicated)."""
    return ModelShape(model).embedding_parameters(t)


def head_parameter_count(model: GPTConfig, t: int = 1) -> int:
    """The final norm and the untied head's V·h/t rows (no bias) on one of t tp ranks."""
    return ModelShape(model).head_parameters(t)


def tp_shard_parameter_count(model: GPTConfig, t: int) -> int:
    """Ψ_t, the parameters one tensor-parallel rank holds (Ψ_1 = Ψ):

        V·h/t (token rows) + s·h (positions, replicated) + final norm + V·h/t (head rows)
        + L·`tp_layer_parameter_count`
    """
    if model.moe_experts:
        if t == 1:
            return parameter_count(model)
        refuse_moe(model, "tensor-parallel shard counts")
    return embedding_parameter_count(model, t) + model.n_layers * tp_layer_parameter_count(model, t) \
        + head_parameter_count(model, t)


def tp_local_parameter_count(model: GPTConfig, layout: Layout) -> int:
    """What rank 0 holds when the model is cut over tp only (Ψ_t; Ψ without tp): the registry's
    `local_parameters` of every strategy that does not pipeline or shard experts."""
    return tp_shard_parameter_count(model, layout.dims.tp)


def sequence_sharded_parameter_count(model: GPTConfig, layers: int | None = None, first: bool = True,
                                     last: bool = True) -> int:
    """Replicated parameters whose gradient is partial under sequence parallelism: per layer two
    norms (4h for LayerNorms, 2h for RMSNorms) and, with biases, the two row-parallel biases (2h,
    added after the reduce-scatter); the final norm (where `last`) and a learned position table
    (s·h where `first`, each rank adds only its piece's positions). `layers` (every block where
    None), `first`, `last`: one pipeline stage's."""
    refuse_moe(model, "sequence-parallel parameter counts")
    h, s = model.d_model, model.seq_len
    layers = model.n_layers if layers is None else layers
    positions = 0 if model.rope else s * h
    return layers * (2 * model.norm_parameters + 2 * h * model.bias) + model.norm_parameters * last \
        + positions * first


def part_parameter_counts(model: GPTConfig) -> list[int]:
    """Parameters of each part of the model, in forward order: the embedding (V·h + s·h for GPT-2),
    each Block (12h² + 13h for GPT-2's; an MoE block (E-1) MLPs and h·E more), the head (2h + V·h:
    final LayerNorm and the untied LM head; a tied head holds its norm only)."""
    block = tp_layer_parameter_count(model, 1)
    blocks = [block + (moe_extra_parameters(model) if model.is_moe_block(i) else 0) for i in range(model.n_layers)]
    return [embedding_parameter_count(model), *blocks, head_parameter_count(model)]


def zero_padded_parameter_count(model: GPTConfig, n: int) -> int:
    """Ψ_pad: ZeRO shards each part's flat buffer, padded to a multiple of the dp size n, so the
    bytes it moves and holds are computed on Σ_parts ceil(Ψ_part / n)·n (Ψ_pad = Ψ for n = 1)."""
    return sum(padded(count, n) for count in part_parameter_counts(model))


def active_parameter_count(model: GPTConfig) -> int:
    """Parameters one token's forward multiplies by: Ψ less the E-k experts of each MoE block it does
    not go to, L_moe·(E-k)·(2f·h + f + h) (Ψ for a dense model). The FLOPs per token follow it."""
    if not model.moe_experts:
        return parameter_count(model)
    unused = model.moe_experts - model.moe_top_k  # experts each token does not run through
    return parameter_count(model) - len(model.moe_blocks) * unused * expert_parameters(model)


def replica_group_size(dims: ParallelDims) -> int:
    """The ranks that hold the same parameters and sum their gradients: dp, times cp when the
    sequence is split too (context parallelism replicates every weight over its cp ranks)."""
    return dims.dp * dims.cp


def kv_heads_in_all_to_all(kv_heads: int, cp: int) -> int:
    """a': the K/V heads context parallelism's all-to-all scatters over cp ranks, a_kv where cp divides
    them, else cp (each kv head replicated cp/a_kv times, one copy per rank): what its bytes
    (cp/theory.py) and the gathered K and V its inner core saves (activations.py) are counted on."""
    return kv_heads if kv_heads % cp == 0 else cp


# -- the formats a collective carries (parallel.comm_dtype) ------------------------------------------
# Written apart from parallel/sync/quantize.py, whose packed buffers the log counts: the closed form
# must not read the code it checks.
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 1}
SCALE_BLOCK, SCALE_BYTES = 256, 4  # int8 and fp8: one fp32 scale per block of 256 elements
BLOCK_SCALED = ("int8", "fp8")


def wire_bytes(comm_dtype: str, elements: int) -> int:
    """Bytes of `elements` values sent as one chunk in `comm_dtype`: B per element, and for the
    block-scaled formats (int8, fp8) a 4-byte scale per started block of 256 (docs/low-precision-collectives.md)."""
    scales = -(-elements // SCALE_BLOCK) * SCALE_BYTES if comm_dtype in BLOCK_SCALED else 0
    return elements * ELEMENT_BYTES[comm_dtype] + scales


def comm_dtype_factor(comm_dtype: str) -> Fraction:
    """The bytes a format sends per fp32 byte, for tensors of whole blocks: 1 for fp32, 1/2 for
    bf16, (256 + 4)/(4·256) = 65/256 for int8 and fp8 (the planner's per-format factor)."""
    return Fraction(wire_bytes(comm_dtype, SCALE_BLOCK), ELEMENT_BYTES["fp32"] * SCALE_BLOCK)


def scattered_part_bytes(model: GPTConfig, n: int, comm_dtype: str) -> int:
    """A reduce-scatter of every part's padded flat buffer over n ranks as the block-scaled
    collectives send it (an all-to-all of n chunks per part, each padded(Ψ_part, n)/n elements with
    its own scales), or, the same bytes, an all-gather of every part: Σ_parts n·wire(padded/n)."""
    return sum(n * wire_bytes(comm_dtype, padded(count, n) // n) for count in part_parameter_counts(model))


# -- ring factors -----------------------------------------------------------------------------------
def all_reduce_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    """A ring all-reduce of S bytes over n ranks: each rank sends 2(n-1)/n·S (nothing alone)."""
    return Fraction(2 * (n - 1), n) * payload_bytes if n > 1 else Fraction(0)


def gather_or_scatter_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    """A ring all-gather (of S bytes of output) or reduce-scatter (of S bytes of input): (n-1)/n·S."""
    return Fraction(n - 1, n) * payload_bytes


# -- the figures a summary compares -------------------------------------------------------------------
def figure(totals_by_op: dict[str, tuple[int, Fraction]], ranks: int, by_group: dict[str, Fraction] | None = None,
           extra: dict | None = None) -> dict:
    """(payload, sent) per op summed over all ranks, and the sent bytes per group summed over all
    ranks (the groups that send nothing left out) -> the summary's expected_comm block."""
    by_op = {
        op: {"payload_bytes": payload, "sent_bytes": float(sent), "sent_bytes_exact": str(sent)}
        for op, (payload, sent) in totals_by_op.items()
    }
    total = sum((sent for _, sent in totals_by_op.values()), Fraction(0))
    groups = {} if by_group is None else {
        "by_group": {g: {"sent_bytes": float(v), "sent_bytes_exact": str(v)} for g, v in by_group.items() if v}}
    return {
        "sent_bytes_per_step": float(total),
        "sent_bytes_per_step_exact": str(total),
        "sent_bytes_per_rank_per_step": float(total / ranks),  # the mean, where ranks differ
        "by_op": by_op,
        **groups,
        **(extra or {}),
    }


def all_ranks(per_rank: dict[str, tuple[int, Fraction]], ranks: int) -> dict[str, tuple[int, Fraction]]:
    """(payload, sent) per op of one rank, where every rank is alike, summed over all ranks."""
    return {op: (payload * ranks, sent * ranks) for op, (payload, sent) in per_rank.items()}


def no_comm(model: GPTConfig, layout: Layout) -> dict:
    """One process: nothing crosses between ranks."""
    return figure({}, layout.dims.world_size)


def state_figures(params: int, grads: int, state: int, counted: int) -> dict:
    """One rank's model state: parameters, gradients and optimizer state in bytes, their total, and
    the parameters counted (the summary's memory.theory.model_state_bytes)."""
    figures = {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state}
    return {**figures, "total_bytes": params + grads + state, "parameters_counted": counted}
