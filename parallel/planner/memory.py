"""Memory per rank, in closed form: what autograd saves for backward, and the model state.

Activations: the bytes this GPT's own ops save for backward (docs/theory/planner.md derives each
term), counted the way parallel/report/activations.py measures them: distinct storages, at the
step's peak, parameters left out. For one microbatch of b sequences of s tokens (n = b·s), a
block on one of t tensor-parallel ranks saves, with B bytes per activation element (4 in fp32):

    ln1, ln2           their input (n_sp·h·B each, n_sp = n/t under sequence parallelism, else n)
                       and per token mean and 1/std in fp32 (2·n_sp·4; RMSNorm only 1/std)
    attention input    the norm's output, or its all-gather under SP: n·h·B, read by Q, K and V
    Q, K, V outputs    n·(h + 2·h_kv)/t·B (grouped-query attention: h_kv = kv heads x head size)
    attention core     its output n·h/t·B (also the output projection's input: one storage) and
                       the log-sum-exp per head and token, b·(a/t)·s·4 (the flash kernel's)
    MLP input          n·h·B (the norm's output, or its all-gather)
    MLP                GELU: fc's output and GELU's output, 2·n·f/t·B
                       gated: gate, up, silu(gate) and the product, 4·n·f/t·B

so 4 + 4/t units of n·h·B + 2·n·f/t·B per layer (16·n·h·B for the GPT at t = 1), against
Korthikanti et al.'s 34 + 5·a·s/h half-precision bytes per token and width: this model has no
dropout masks and its attention core never holds the s x s scores.

The embedding saves the token ids (without tp: the storage they are a view of, the whole global
batch's inputs, G·s·8; with tp the vocab-parallel lookup's masked ids n·8 and mask n·1) and each
microbatch's positions (s·8, or s/t·8 under SP). The head saves ln_f's input and statistics, the
head's input n·h·B, and the loss's fp32 log-probabilities n·V·4 with the targets' storage (G·s·8)
and a 4-byte total weight (vocab-parallel loss instead: its softmax slice n·V/t·4, masked targets
n·8 and mask n·1).

Per rank: without a pipeline, one microbatch's forward is saved at a time (m microbatches are
accumulated one after the other). In a pipeline each rank holds the chunks of the microbatches
whose forward has run and whose backward has not; the peak is found by walking the rank's
schedule (parallel/pp/schedules.py, the lists the simulator checks and the executor runs), adding
a chunk's bytes at its forward and removing them at its backward. The global batch's input and
target storages are held once while any microbatch that reads them is in flight.

Model state: parameters, gradients and optimizer state per rank (the families' theory.py formulas, for any
`ModelShape`): fp32 training holds 4 + 4 + 8 bytes per parameter; bf16 mixed precision 2 (bf16
weights) + 2 (bf16 gradients) + 12 (fp32 master weights and Adam's two moments), the ZeRO paper's
K = 12. ZeRO stage k shards, over the dp ranks: 1 the optimizer state, 2 also the gradients, 3 also
the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from parallel.algebra import padded
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.pp.schedules import F, build_schedule, compute_only, virtual_stage

INDEX_BYTES = 8  # int64 token ids and positions
STAT_BYTES = 4  # LayerNorm's mean and 1/std, the flash kernel's log-sum-exp: fp32 whatever the activations
LOSS_BYTES = 4  # the loss runs in fp32 (token_loss_sum casts the logits)


def _shape(model: GPTConfig | ModelShape) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape(gpt=model)


def covers(model: GPTConfig | ModelShape, layout: Layout) -> bool:
    """Whether these formulas describe the layout: dense blocks; no context or expert split; no
    recomputation (other formulas own those)."""
    shape = _shape(model)
    dims = layout.dims
    return (not shape.gpt.moe_experts and dims.cp == 1 and dims.ep == 1
            and getattr(layout, "recompute", "none") in (None, "none"))


# -- what each part saves for one microbatch ----------------------------------------------------------
def block_saved_bytes(model: GPTConfig | ModelShape, b: int, t: int = 1, sequence_parallel: bool = False,
                      act_bytes: int = 4) -> int:
    """One block's saved bytes for one microbatch of b sequences on one of t tp ranks (see the module)."""
    shape = _shape(model)
    g = shape.gpt
    n, h, B = b * g.seq_len, g.d_model, act_bytes
    n_sp = n // t if sequence_parallel else n
    stats = 2 if shape.norm == "layernorm" else 1
    norms = 2 * (n_sp * h * B + stats * n_sp * STAT_BYTES)
    region_inputs = 2 * n * h * B  # attention's and the MLP's input, replicated or gathered
    qkv = n * (h + 2 * shape.kv_width) // t * B
    core = n * h // t * B + b * (g.n_heads // t) * g.seq_len * STAT_BYTES
    mlp = (4 if shape.gated_mlp else 2) * n * shape.ffn // t * B
    return norms + region_inputs + qkv + core + mlp


def embedding_saved_bytes(model: GPTConfig | ModelShape, b: int, t: int = 1, sequence_parallel: bool = False) -> int:
    """Per microbatch: the positions (s·8, or s/t·8 under SP), and with tp the vocab-parallel
    lookup's masked ids (n·8) and mask (n·1). Without tp the ids are a view of the global batch's
    storage, counted once per rank by `global_batch_bytes`."""
    g = _shape(model).gpt
    n = b * g.seq_len
    positions = (g.seq_len // t if sequence_parallel else g.seq_len) * INDEX_BYTES
    return positions + (n * INDEX_BYTES + n if t > 1 else 0)


def head_saved_bytes(model: GPTConfig | ModelShape, b: int, t: int = 1, sequence_parallel: bool = False,
                     act_bytes: int = 4) -> int:
    """Per microbatch: ln_f's input and statistics, the head's input, and the loss's saved tensors
    (log-probabilities n·V·4 and a 4-byte total weight; with tp the softmax slice n·V/t·4, masked
    targets n·8 and mask n·1). Without tp the targets are a view of the global batch's storage."""
    shape = _shape(model)
    g = shape.gpt
    n, h = b * g.seq_len, g.d_model
    n_sp = n // t if sequence_parallel else n
    stats = 2 if shape.norm == "layernorm" else 1
    norm = n_sp * h * act_bytes + stats * n_sp * STAT_BYTES
    loss = n * g.padded_vocab_size // t * LOSS_BYTES + (n * INDEX_BYTES + n if t > 1 else LOSS_BYTES)
    return norm + n * h * act_bytes + loss


def global_batch_bytes(model: GPTConfig | ModelShape, global_batch: int) -> int:
    """The global batch's inputs (or targets) as one int64 storage, G·s·8: every microbatch's ids
    without tp (and its targets) are views of it, so it is held once while any of them is."""
    return global_batch * _shape(model).gpt.seq_len * INDEX_BYTES


# -- per rank -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkBytes:
    """What one virtual stage saves per microbatch, and which global-batch storages it reads."""

    per_microbatch: int
    reads_inputs: bool  # the first virtual stage, without tp: the ids are views of the global inputs
    reads_targets: bool  # the last virtual stage, without tp


def chunk_bytes(model: GPTConfig | ModelShape, layout: Layout, vstage: int, layers: list[int],
                act_bytes: int = 4) -> ChunkBytes:
    t, sp, b = layout.dims.tp, layout.sequence_parallel and layout.dims.tp > 1, layout.microbatch_size
    first, last = vstage == 0, vstage == len(layers) - 1
    total = layers[vstage] * block_saved_bytes(model, b, t, sp, act_bytes)
    if first:
        total += embedding_saved_bytes(model, b, t, sp)
    if last:
        total += head_saved_bytes(model, b, t, sp, act_bytes)
    return ChunkBytes(total, first and t == 1, last and t == 1)


def virtual_stage_layers(model: GPTConfig | ModelShape, layout: Layout) -> list[int]:
    from parallel.pp.split import layer_counts

    pieces = layout.dims.pp * layout.virtual_stages
    explicit = list(layout.pp_layers) if layout.pp_layers is not None else None
    return layer_counts(_shape(model).gpt.n_layers, pieces, explicit)


def activation_bytes_by_rank(model: GPTConfig | ModelShape, layout: Layout, global_batch: int,
                             act_bytes: int = 4) -> list[int] | None:
    """Bytes saved for backward at the step's peak on every rank, in rank order (None where the
    formulas do not cover the layout: see `covers`)."""
    if not covers(model, layout):
        return None
    dims = layout.dims
    layers = virtual_stage_layers(model, layout)
    batch = global_batch_bytes(model, global_batch)
    p, v, m = dims.pp, layout.virtual_stages, layout.microbatches
    chunks = [chunk_bytes(model, layout, vs, layers, act_bytes) for vs in range(p * v)]
    if p == 1:
        peaks = [_peak_one_at_a_time(chunks, batch)]
    else:
        plans = compute_lists(layout.schedule, p, m, v)
        peaks = [_peak_in_flight(plans[r], r, p, chunks, batch) for r in range(p)]
    return [peaks[dims.coordinates(rank)["pp"]] for rank in range(dims.world_size)]


@lru_cache(maxsize=1024)
def compute_lists(schedule: str, p: int, m: int, v: int) -> tuple[tuple, ...]:
    """Each rank's forwards and backwards in the schedule's order (built once per schedule and shape)."""
    return tuple(tuple(compute_only(actions)) for actions in build_schedule(schedule, p, m, v))


def _peak_one_at_a_time(chunks: list[ChunkBytes], batch: int) -> int:
    """No pipeline: each microbatch's forward is saved, then freed by its backward."""
    (chunk,) = chunks
    return chunk.per_microbatch + batch * (chunk.reads_inputs + chunk.reads_targets)


def _peak_in_flight(actions, rank: int, stages: int, chunks: list[ChunkBytes], batch: int) -> int:
    """Walk one rank's forwards and backwards: a forward adds its chunk's bytes, a backward removes
    them; the global batch's storages count while a chunk reading them is in flight."""
    held, peak = 0, 0
    readers = {"inputs": 0, "targets": 0}
    for a in actions:
        chunk = chunks[virtual_stage(rank, a.chunk, stages)]
        sign = 1 if a.op == F else -1
        held += sign * chunk.per_microbatch
        readers["inputs"] += sign * chunk.reads_inputs
        readers["targets"] += sign * chunk.reads_targets
        peak = max(peak, held + batch * ((readers["inputs"] > 0) + (readers["targets"] > 0)))
    return peak


def registry_activations(cfg: GPTConfig, layout: Layout, global_batch: int | None = None) -> list[int] | None:
    """The registry's `activations` formula (summary memory.theory.activation_bytes): fp32, this GPT.
    The global batch is dp x microbatches x microbatch size.

    Context parallelism and recomputation are activations.activation_bytes's (docs/theory/memory.md),
    which walks the same ops with the sequence cut and the recomputed regions; where both formulas
    apply (one stage, no tp) they are the same figure (tests/test_planner_memory.py)."""
    if not covers(cfg, layout):
        from parallel.activations import activation_bytes

        return activation_bytes(cfg, layout)
    if global_batch is None:
        global_batch = layout.dims.dp * layout.microbatches * layout.microbatch_size
    return activation_bytes_by_rank(cfg, layout, global_batch, act_bytes=layout.dtype_bytes)


# -- model state ----------------------------------------------------------------------------------------
# Bytes per parameter of (parameters, gradients, optimizer state): fp32 training keeps fp32 weights,
# gradients and Adam's two moments; bf16 mixed precision keeps bf16 weights and gradients, and an
# fp32 master copy with the two moments in the optimizer (ZeRO paper §3.1: 2 + 2 + K, K = 12).
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


def stage_parts(shape: ModelShape, t: int, layers: int, first: bool, last: bool, stages: int) -> list[int]:
    """One rank's parts (ZeRO's unit of sharding: embedding, each block, head) on its stage, each cut
    over t tp ranks (compose.theory.stage_part_counts for the GPT)."""
    return [*([shape.embedding_parameters(t)] if first else []), *[shape.layer_parameters(t)] * layers,
            *([shape.head_parameters(t, copy_of_tied=stages > 1)] if last else [])]


def rank_layers(shape: ModelShape, layout: Layout) -> list[int]:
    """Blocks each pipeline rank holds over its chunks (compose.theory.stage_layers)."""
    counts = virtual_stage_layers(shape, layout)
    p = layout.dims.pp
    return [sum(counts[c * p + r] for c in range(layout.virtual_stages)) for r in range(p)]


def model_state_bytes(shape: ModelShape, layout: Layout, zero: int, precision: str, pp_rank: int) -> dict:
    """Parameters, gradients and optimizer state on one rank of stage `pp_rank`: its tp shard of the
    stage's parts; under ZeRO stage k over d dp ranks each part padded to a multiple of d and
    1/d of it kept for the optimizer state (k >= 1), the gradients (k >= 2), the parameters (k = 3).
    Equal to compose.theory.mesh3d_model_state_bytes and theory.zero_model_state_bytes for the GPT in fp32."""
    p, t, d = layout.dims.pp, layout.dims.tp, layout.dims.dp
    layers = rank_layers(shape, layout)[pp_rank]
    parts = stage_parts(shape, t, layers, pp_rank == 0, pp_rank == p - 1, p)
    count = sum(padded(n, d) for n in parts) if zero else sum(parts)
    param_b, grad_b, state_b = STATE_BYTES[precision]
    return {"params": count * param_b // (d if zero >= 3 else 1),
            "grads": count * grad_b // (d if zero >= 2 else 1),
            "optimizer": count * state_b // (d if zero >= 1 else 1),
            "parameters_counted": count}


def buffer_bytes(shape: ModelShape, layout: Layout, zero: int, precision: str, pp_rank: int) -> int:
    """Transient tensors beside the saved activations at the peak, on one rank of stage `pp_rank`:

    * the last stage's logits, n·V/t in fp32 (alive next to the saved log-probabilities until the
      loss has read them; the same size again as their gradient in backward);
    * a tp region's summed output, n·h·B (the all-reduce works on a copy);
    * ZeRO-3: one part's gathered parameters and its full gradient before the reduce-scatter;
      ZeRO-2: one part's full gradient before the reduce-scatter (the largest part's).
    """
    g = shape.gpt
    p, t, d = layout.dims.pp, layout.dims.tp, layout.dims.dp
    param_b, grad_b, _ = STATE_BYTES[precision]
    act_b = 4 if precision == "fp32" else 2
    n = layout.microbatch_size * g.seq_len
    total = n * g.padded_vocab_size // t * LOSS_BYTES if pp_rank == p - 1 else 0
    if t > 1:
        total += n * g.d_model * act_b
    if zero >= 2:
        layers = rank_layers(shape, layout)[pp_rank]
        largest = max(stage_parts(shape, t, layers, pp_rank == 0, pp_rank == p - 1, p))
        largest = padded(largest, d)
        total += largest * grad_b + (largest * param_b if zero >= 3 else 0)
    return total
