"""Bytes saved for backward, in closed form: what autograd keeps of this GPT's ops per rank at the
step's peak, for any cut (docs/theory/memory.md, docs/theory/planner.md derive each term).

Counted the way parallel/report/activations.py measures them (distinct storages, at the step's
peak, parameters left out), and like every theory file derived from the shape alone, independent
of the model's tensors and of the measurement it is checked against.

Two derivations of the same ops, each where the other is not written: the walk (any shape of
parallel/core/shape.py, tp, sp, pipelines; no cp, no recomputation) and `activation_terms` (the GPT
with the sequence cut over cp and under recomputation; one stage, no tp). Where both apply they are
the same figure (tests/tools/test_planner_memory.py).

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
schedule (parallel/pp/schedules.py, the lists the simulator checks and the executor runs, handed in by
parallel/pp/theory.py), adding
a chunk's bytes at its forward and removing them at its backward. The global batch's input and
target storages are held once while any microbatch that reads them is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parallel.algebra import FP32_BYTES, ID_BYTES
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout

STAT_BYTES = 4  # LayerNorm's mean and 1/std, the flash kernel's log-sum-exp: fp32 whatever the activations
LOSS_BYTES = 4  # the loss runs in fp32 (token_loss_sum casts the logits)


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


# -- the walk: any shape, tp, sp and pipelines ----------------------------------------------------------
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
    positions = (g.seq_len // t if sequence_parallel else g.seq_len) * ID_BYTES
    return positions + (n * ID_BYTES + n if t > 1 else 0)


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
    loss = n * g.padded_vocab_size // t * LOSS_BYTES + (n * ID_BYTES + n if t > 1 else LOSS_BYTES)
    return norm + n * h * act_bytes + loss


def global_batch_bytes(model: GPTConfig | ModelShape, global_batch: int) -> int:
    """The global batch's inputs (or targets) as one int64 storage, G·s·8: every microbatch's ids
    without tp (and its targets) are views of it, so it is held once while any of them is."""
    return global_batch * _shape(model).gpt.seq_len * ID_BYTES


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


def activation_bytes_by_rank(model: GPTConfig | ModelShape, layout: Layout, global_batch: int, act_bytes: int = 4,
                             layers: Sequence[int] | None = None,
                             walk: Sequence[Sequence[tuple[bool, int]]] | None = None) -> list[int] | None:
    """Bytes saved for backward at the step's peak on every rank, in rank order (None where the
    formulas do not cover the layout: see `covers`).

    `layers` are the blocks of each virtual stage and, in a pipeline, `walk` each pipeline rank's
    forwards and backwards in its schedule's order as (is_forward, virtual stage): the pipeline's
    own (parallel/pp/theory.py's `schedule_walk`), passed in so that this formula stays below the
    families."""
    if not covers(model, layout):
        return None
    dims = layout.dims
    layers = list(layers) if layers is not None else [_shape(model).gpt.n_layers]
    batch = global_batch_bytes(model, global_batch)
    p = dims.pp
    chunks = [chunk_bytes(model, layout, vs, layers, act_bytes) for vs in range(len(layers))]
    if p == 1:
        peaks = [_peak_one_at_a_time(chunks, batch)]
    else:
        if walk is None:
            raise ValueError(f"{p} pipeline stages: pass each rank's walk of its schedule (parallel/pp/theory.py)")
        peaks = [_peak_in_flight(walk[r], chunks, batch) for r in range(p)]
    return [peaks[dims.coordinates(rank)["pp"]] for rank in range(dims.world_size)]


def _peak_one_at_a_time(chunks: list[ChunkBytes], batch: int) -> int:
    """No pipeline: each microbatch's forward is saved, then freed by its backward."""
    (chunk,) = chunks
    return chunk.per_microbatch + batch * (chunk.reads_inputs + chunk.reads_targets)


def _peak_in_flight(walk: Sequence[tuple[bool, int]], chunks: list[ChunkBytes], batch: int) -> int:
    """Walk one rank's forwards and backwards: a forward adds its chunk's bytes, a backward removes
    them; the global batch's storages count while a chunk reading them is in flight."""
    held, peak = 0, 0
    readers = {"inputs": 0, "targets": 0}
    for forward, vstage in walk:
        chunk = chunks[vstage]
        sign = 1 if forward else -1
        held += sign * chunk.per_microbatch
        readers["inputs"] += sign * chunk.reads_inputs
        readers["targets"] += sign * chunk.reads_targets
        peak = max(peak, held + batch * ((readers["inputs"] > 0) + (readers["targets"] > 0)))
    return peak


def registry_activations(cfg: GPTConfig, layout: Layout, global_batch: int | None = None,
                         layers: Sequence[int] | None = None,
                         walk: Sequence[Sequence[tuple[bool, int]]] | None = None) -> list[int] | None:
    """The registry's `activations` formula (summary memory.theory.activation_bytes): fp32, this GPT.
    The global batch is dp x microbatches x microbatch size.

    Context parallelism and recomputation are `activation_bytes`'s (docs/theory/memory.md), which
    walks the same ops with the sequence cut and the recomputed regions; where both formulas apply
    (one stage, no tp) they are the same figure (tests/tools/test_planner_memory.py)."""
    if not covers(cfg, layout):
        return activation_bytes(cfg, layout)
    if global_batch is None:
        global_batch = layout.dims.dp * layout.microbatches * layout.microbatch_size
    return activation_bytes_by_rank(cfg, layout, global_batch, layout.dtype_bytes, layers, walk)
