"""Bytes saved for backward, in closed form: what autograd keeps of this GPT's ops per rank at the
step's peak, for any cut (docs/theory/memory.md, docs/theory/planner.md derive each term).

Counted the way parallel/report/activations.py measures them (distinct storages, at the step's
peak, parameters left out), and like every theory file derived from the shape alone, independent
of the model's tensors and of the measurement it is checked against.

One derivation: what each part (the embedding, a block, the head) saves for one microbatch on one
rank (`Cut`: b sequences, each of s/cp tokens, cut over t tp ranks, with or without sequence
parallelism, the cp kind), then the peak per rank: without recomputation by walking the rank's
forwards and backwards (a pipeline's schedule, handed in by parallel/pp/theory.py); under
recomputation (one stage) with each block's dropped terms and the recomputation's own peak.
`covers` says where it is written: dense blocks, no dropout, no expert split; context parallelism
on one stage without tp, recomputation on any stage and tp, in fp32.

For one microbatch of b sequences of s_r = s/cp tokens on a rank (n = b·s_r), a block on one of t
tensor-parallel ranks saves, with B bytes per activation element (4 in fp32):

    ln1, ln2           their input (n_sp·h·B each, n_sp = n/t under sequence parallelism, else n)
                       and per token mean and 1/std in fp32 (2·n_sp·4; RMSNorm only 1/rms, n_sp·4:
                       parallel/core/norm.py's, which keeps no normalized copy)
    attention input    the norm's output, or its all-gather under SP: n·h·B, read by Q, K and V
                       (under SP with the sequence piece saved, `Cut.saves_shard`, this rank's piece of it, n/t·h·B,
                       gathered again in backward; the MLP's and the head's inputs likewise)
    Q, K, V outputs    n·(h/t + 2·h_kv,t)·B (grouped-query attention: h_kv,t = this rank's kv heads x
                       head size, h_kv/t, or one head's where t exceeds the kv heads and each is
                       replicated: `ModelShape.kv_width_per_rank`; under the all-to-all the gathered
                       q, k, v instead, of the same size; rotary positions save nothing more: the
                       rotated q and k are what the core keeps, the angles are recomputed in backward)
    attention core     its output n·h/t·B (also the output projection's input: one storage; the
                       all-to-all's is a copy) and the log-sum-exp per head and token, b·(a/t)·s_r·4;
                       the all-to-all's inner core also its own output and lse and two int64 index
                       tensors of s
    MLP input          n·h·B (the norm's output, or its all-gather; or the piece, n/t·h·B)
    MLP                GELU: fc's output and GELU's output, 2·n·f/t·B
                       gated: gate, up, silu(gate) and the product, 4·n·f/t·B

so 4 + 4/t units of n·h·B + 2·n·f/t·B per layer (16·n·h·B for the GPT at t = 1), besides the norms'
statistics; under sequence parallelism 2 + 6/t units (the norm inputs are pieces), and 8/t with the
sequence piece saved (the column-parallel inputs too: everything over t), against
Korthikanti et al.'s 34 + 5·a·s/h half-precision bytes per token and width: this model has no
dropout masks and its attention core never holds the s x s scores.

The embedding saves the token ids (without tp or cp: the storage they are a view of, the whole
global batch's inputs, G·s·8; under cp the rank's own copy n·8; with tp the vocab-parallel
lookup's masked ids n·8 and mask n·1) and each microbatch's positions (s_r·8, or s_r/t·8 under SP).
The head saves ln_f's input and statistics, the head's input n·h·B (n/t·h·B when saved as the piece),
and the loss's fp32 log-probabilities n·V·4 with the targets (as the ids) and a 4-byte total weight (vocab-parallel
loss instead: its softmax slice n·V/t·4, masked targets n·8 and mask n·1).

Per rank: without a pipeline, one microbatch's forward is saved at a time (m microbatches are
accumulated one after the other). In a pipeline each rank holds the chunks of the microbatches
whose forward has run and whose backward has not; the peak is found by walking the rank's
schedule (parallel/pp/schedules.py, the lists the simulator checks and the executor runs), adding
a chunk's bytes at its forward and removing them at its backward. The global batch's input and
target storages are held once while any microbatch that reads them is in flight.

Recomputation (docs/theory/memory.md): selective drops each block's attention core (what only the
core saves) and peaks at the larger of the forward's end and the last core's recomputation in
backward; full keeps only each block's input and, after the head's backward, recomputes the last
block whole. In a pipeline every chunk in flight keeps its blocks' kept sets, and each backward holds
its last block's recomputed tensors beside them (`kept_and_recomputed`, `peak_in_flight`). A split
backward (zero-bubble schedules) keeps a chunk's saved tensors from its B until its W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parallel.algebra import FP32_BYTES, ID_BYTES, kv_heads_in_all_to_all
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Cut, Layout

STAT_BYTES = 4  # LayerNorm's mean and 1/std, the flash kernel's log-sum-exp: fp32 whatever the activations
LOSS_BYTES = 4  # the loss runs in fp32 (token_loss_sum casts the logits)


def _shape(model: GPTConfig | ModelShape) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape(gpt=model)


def covers(model: GPTConfig | ModelShape, layout: Layout) -> bool:
    """Whether these formulas describe the layout: dense blocks without dropout, no expert split;
    context parallelism on one stage (with tp, sequence parallelism and either saving too),
    recomputation on any stage and tp, in fp32 (where they are derived and measured:
    tests/unit/test_recompute.py, tests/runs/test_cp.py, tests/tools/test_planner_memory.py)."""
    g, dims = _shape(model).gpt, layout.dims
    if g.moe_experts or g.dropout or dims.ep > 1:
        return False
    if dims.cp == 1 and layout.recompute in (None, "none"):
        return True
    if dims.cp == 1:  # recomputation: on every schedule's walk, over tp too (tests/tools/test_planner_memory.py)
        return layout.precision == "fp32"
    return dims.pp == 1 and layout.precision == "fp32"


# The formulas count what the CPU's attention kernel saves (torch 2.13, _scaled_dot_product_flash_
# attention_for_cpu: its output and a log-sum-exp of s rows per head). On CUDA, scaled_dot_product_
# attention picks its kernel by GPU, dtype and shape, and each saves other tensors for backward
# (torch 2.13's meta functions, torch/_meta_registrations.py): flash (fp16 and bf16 only) adds the
# dropout generator's seed and offset; memory-efficient (fp32's kernel) pads its log-sum-exp to a
# multiple of 32 rows and adds the seed and offset; math saves the s x s attention weights. Which
# one runs is the machine's choice, so no closed form of this file is its measurement's.
CUDA_ATTENTION_UNCHECKED = (
    "not checked on CUDA: the formula counts what the CPU attention kernel saves for backward (its output and "
    "a log-sum-exp of s rows per head); CUDA's scaled_dot_product_attention picks flash, memory-efficient, cuDNN "
    "or math attention by GPU, dtype and shape, and they save other tensors (the memory-efficient kernel's "
    "log-sum-exp padded to a multiple of 32 rows, the dropout generator's seed and offset, the math kernel's "
    "s x s weights)")


def activation_check_note(device_type: str) -> str | None:
    """Why the measured bytes saved for backward cannot be held to the formula on this device, or
    None where they can (the CPU, where every formula of this file is measured to the byte)."""
    return CUDA_ATTENTION_UNCHECKED if device_type == "cuda" else None


# -- what each part saves for one microbatch ----------------------------------------------------------
def block_terms(model: GPTConfig | ModelShape, cut: Cut) -> dict[str, int]:
    """One block's saved bytes for one microbatch on one rank, term by term (see the module):

      ln1, ln2          each norm's input and statistics
      attention_input   ln1's output (or its all-gather), read by Q, K and V;  mlp_input: ln2's
                        (under `saves_shard` the piece of the sequence, n/t·h·B)
      qkv, proj_input   what holds q, k, v, and the output projection's input (the core's output)
      core_only         what only the attention core saves (selective recomputation drops it): the
                        lse; under the all-to-all also the inner core's output and the two index tensors
      recomputed        what the core saves again when it reruns in backward (its output and lse; the
                        all-to-all's core_only and gathered q, k, v)
      mlp               the MLP's hidden activations
      input             the block's input, all full recomputation keeps
    """
    shape = _shape(model)
    g = shape.gpt
    s = g.seq_len // cut.cp  # this rank's tokens of each sequence
    n, h, B, t = cut.b * s, g.d_model, cut.act_bytes, cut.t
    n_sp = n // t if cut.sequence_parallel else n
    norm = n_sp * h * B + (2 if shape.norm == "layernorm" else 1) * n_sp * STAT_BYTES
    column_input = n // cut.column_input_tokens * h * B  # what Q, K, V (or fc) keep of their input
    qkv = n * (h // t + 2 * shape.kv_width_per_rank(t)) * B
    out, lse = n * h // t * B, cut.b * (g.n_heads // t) * s * STAT_BYTES
    if cut.cp > 1 and cut.cp_kind == "a2a":
        # The inner core holds the gathered q, k, v: K and V with a' heads per rank, a_kv or, where cp
        # exceeds them, cp replicas.
        kv = kv_heads_in_all_to_all(shape.kv_heads_per_rank(t), cut.cp)
        qkv = n * (g.n_heads // t + 2 * kv) * g.head_dim * B
        core_only = out + lse + 2 * g.seq_len * ID_BYTES  # the inner core's output and lse, the two index maps
        recomputed = core_only + qkv  # and the gathered q, k, v again
    else:
        core_only, recomputed = lse, out + lse
    return {"ln1": norm, "ln2": norm, "attention_input": column_input, "mlp_input": column_input, "qkv": qkv,
            "proj_input": out, "core_only": core_only, "recomputed": recomputed,
            "mlp": (4 if shape.gated_mlp else 2) * n * shape.ffn // t * B, "input": n_sp * h * B}


SAVED_TERMS = ("ln1", "ln2", "attention_input", "mlp_input", "qkv", "proj_input", "core_only", "mlp")


def block_saved_bytes(model: GPTConfig | ModelShape, cut: Cut) -> int:
    """One block's saved bytes for one microbatch on one rank, without recomputation."""
    terms = block_terms(model, cut)
    return sum(terms[k] for k in SAVED_TERMS)


def embedding_saved_bytes(model: GPTConfig | ModelShape, cut: Cut) -> int:
    """Per microbatch: the learned table's positions (s_r·8, or s_r/t·8 under SP; none under rotary
    positions, which save nothing), with tp the vocab-parallel lookup's masked ids (n·8) and mask (n·1),
    under cp the rank's own copy of its ids (n·8). Without either the ids are a view of the global
    batch's storage, counted once per rank by `global_batch_bytes`."""
    g = _shape(model).gpt
    s = g.seq_len // cut.cp
    n = cut.b * s
    positions = 0 if g.rope else (s // cut.t if cut.sequence_parallel else s) * ID_BYTES
    return positions + (n * ID_BYTES + n if cut.t > 1 else n * ID_BYTES if cut.cp > 1 else 0)


def head_saved_bytes(model: GPTConfig | ModelShape, cut: Cut) -> int:
    """Per microbatch: ln_f's input and statistics, the head's input, and the loss's saved tensors
    (`loss_saved_bytes`)."""
    shape = _shape(model)
    g = shape.gpt
    n, h, t, B = cut.b * g.seq_len // cut.cp, g.d_model, cut.t, cut.act_bytes
    n_sp = n // t if cut.sequence_parallel else n
    norm = n_sp * h * B + (2 if shape.norm == "layernorm" else 1) * n_sp * STAT_BYTES
    head_input = n // cut.column_input_tokens * h * B  # the gathered input, or the piece (saves_shard)
    return norm + head_input + loss_saved_bytes(model, cut)


def loss_saved_bytes(model: GPTConfig | ModelShape, cut: Cut) -> int:
    """Per microbatch, the loss's saved tensors: log-probabilities n·V·4 and a 4-byte total weight, under cp
    with the rank's own targets n·8; with tp the softmax slice n·V/t·4, masked targets n·8 and mask n·1.
    Without tp or cp the targets are a view of the global batch's storage."""
    g = _shape(model).gpt
    n, t = cut.b * g.seq_len // cut.cp, cut.t
    targets = n * ID_BYTES + n if t > 1 else LOSS_BYTES + (n * ID_BYTES if cut.cp > 1 else 0)
    return n * g.padded_vocab_size // t * LOSS_BYTES + targets


def global_batch_bytes(model: GPTConfig | ModelShape, global_batch: int) -> int:
    """The global batch's inputs (or targets) as one int64 storage, G·s·8: every microbatch's ids
    without tp or cp (and its targets) are views of it, so it is held once while any of them is."""
    return global_batch * _shape(model).gpt.seq_len * ID_BYTES


# -- per rank -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkBytes:
    """What one virtual stage saves per microbatch, which global-batch storages it reads, and what its
    backward holds beyond that for a moment (under recomputation: its last block's recomputed tensors)."""

    per_microbatch: int
    reads_inputs: bool  # the first virtual stage, without tp or cp: the ids are views of the global inputs
    reads_targets: bool  # the last virtual stage, without tp or cp
    recomputing: int = 0
    loss: int = 0  # the last virtual stage's loss tensors, released by a split backward's B (the rest by W)
    # Under a split backward, what B's recomputation adds (nothing of the chunk freed yet: its graph is
    # kept for W). The first virtual stage's B does nothing and its W is a whole backward (`peak_in_flight`).
    recomputing_in_b: int = 0


def kept_and_recomputed(model: GPTConfig | ModelShape, cut: Cut, recompute: str | None) -> tuple[int, int, int]:
    """Per block and microbatch under `train.recompute`: what it keeps through the forward, what its whole
    backward adds beyond that while its recomputed part lives, and what a split backward's B adds, whose
    kept graph frees nothing of the chunk before W (`block_terms`):

      none       the whole set; nothing; nothing
      selective  the set less `core_only`; its ln1, attention input and q, k, v with the rerun core's
                 `recomputed` (the MLP's and the output projection's tensors are freed by then), less the
                 set; `recomputed` whole
      full       its input; its whole set less the input (recomputed whole); the same
    """
    terms = block_terms(model, cut)
    layer = sum(terms[k] for k in SAVED_TERMS)
    if recompute == "selective":
        kept = layer - terms["core_only"]
        return kept, terms["ln1"] + terms["attention_input"] + terms["qkv"] + terms["recomputed"] - kept, \
            terms["recomputed"]
    if recompute == "full":
        return terms["input"], layer - terms["input"], layer - terms["input"]
    return layer, 0, 0


def chunk_bytes(model: GPTConfig | ModelShape, cut: Cut, vstage: int, layers: Sequence[int],
                recompute: str | None = None) -> ChunkBytes:
    """A virtual stage's blocks (each as `kept_and_recomputed` keeps it) and ends. Its backward runs the head's
    first, then recomputes its last block: what that adds counts beyond the head's freed tensors."""
    first, last = vstage == 0, vstage == len(layers) - 1
    kept, recomputed, in_b = kept_and_recomputed(model, cut, recompute)
    head = head_saved_bytes(model, cut) if last else 0
    total = layers[vstage] * kept + head
    if first:
        total += embedding_saved_bytes(model, cut)
    views = cut.t == 1 and cut.cp == 1
    return ChunkBytes(total, first and views, last and views, max(0, recomputed - head) if layers[vstage] else 0,
                      loss_saved_bytes(model, cut) if last else 0, in_b if layers[vstage] else 0)


def activation_terms(model: GPTConfig | ModelShape, layout: Layout) -> dict | None:
    """One stage's bytes saved for backward per rank, term by term, at the step's peak
    (docs/theory/memory.md), for the GPT in fp32 without tp: `stage_terms` (None where the model or
    layout is outside what `covers` says, is cut over tp or pipelined, or is not fp32)."""
    dims = layout.dims
    if not covers(model, layout) or dims.tp > 1 or dims.pp > 1 or layout.precision != "fp32":
        return None
    return stage_terms(model, layout, dims.dp * layout.microbatches * layout.microbatch_size)


def stage_terms(model: GPTConfig | ModelShape, layout: Layout, global_batch: int, act_bytes: int = FP32_BYTES) -> dict:
    """One stage (every block on this rank): `embedding` and `head` with the global batch's storages
    they read, `layer` one block's, and the `peak`. Under L blocks:

      none       E + L·layer + H
      selective  E + max(L·(layer − core_only) + H, the last core's recomputation in backward:
                 (L−1)·(layer − core_only) + ln1 + attention_input + qkv + recomputed)
      full       E + L·input + max(H, layer − input): only each block's input is kept, and after
                 the head's backward the last block is recomputed whole (its input already counted)
    """
    cut, L = layout.cut(act_bytes), _shape(model).gpt.n_layers
    chunk = chunk_bytes(model, cut, 0, [L])
    batch = global_batch_bytes(model, global_batch)
    embedding = embedding_saved_bytes(model, cut) + batch * chunk.reads_inputs
    head = head_saved_bytes(model, cut) + batch * chunk.reads_targets
    terms = block_terms(model, cut)
    layer = block_saved_bytes(model, cut)
    mode = layout.recompute or "none"
    if mode == "none":
        peak = embedding + L * layer + head
    elif mode == "selective":
        kept = layer - terms["core_only"]
        # In backward, the last block's core runs again while its first norm and q, k, v are still held.
        last_core = (L - 1) * kept + terms["ln1"] + terms["attention_input"] + terms["qkv"] + terms["recomputed"]
        peak = embedding + max(L * kept + head, last_core)
    else:
        peak = embedding + L * terms["input"] + max(head, layer - terms["input"])
    return {"embedding": embedding, "layer": layer, "head": head, "peak": peak}


def activation_bytes_by_rank(model: GPTConfig | ModelShape, layout: Layout, global_batch: int, act_bytes: int = 4,
                             layers: Sequence[int] | None = None,
                             walk: Sequence[Sequence[tuple[str, int]]] | None = None) -> list[int] | None:
    """Bytes saved for backward at the step's peak on every rank, in rank order (None where the
    formulas do not cover the layout: see `covers`).

    `layers` are the blocks of each virtual stage and, in a pipeline, `walk` each pipeline rank's
    forwards and backwards in its schedule's order as (op F, B or W, virtual stage): the pipeline's
    own (parallel/pp/theory.py's `schedule_walk`), passed in so that this formula stays below the
    families."""
    if not covers(model, layout):
        return None
    dims = layout.dims
    layers = list(layers) if layers is not None else [_shape(model).gpt.n_layers]
    p = dims.pp
    if p == 1:
        peaks = [stage_terms(model, layout, global_batch, act_bytes)["peak"]]
    else:
        if walk is None:
            raise ValueError(f"{p} pipeline stages: pass each rank's walk of its schedule (parallel/pp/theory.py)")
        cut, batch = layout.cut(act_bytes), global_batch_bytes(model, global_batch)
        chunks = [chunk_bytes(model, cut, vs, layers, layout.recompute) for vs in range(len(layers))]
        peaks = [peak_in_flight(walk[r], chunks, batch) for r in range(p)]
    # pp is the outermost mesh dimension (dims.MESH_DIMS): each stage's ranks follow one another.
    per_stage = dims.world_size // p
    return [peak for peak in peaks for _ in range(per_stage)]


FORWARD, WEIGHTS = "F", "W"  # parallel/pp/actions.py's names: a forward, a split backward's weight half


def peak_in_flight(walk: Sequence[tuple[str, int]], chunks: list[ChunkBytes], batch: int) -> int:
    """Walk one rank's forwards and backwards (op, virtual stage): a forward adds its chunk's bytes, a
    backward removes them (after holding its `recomputing` beside them); the global batch's storages count
    while a chunk reading them is in flight. Where the walk has W (a split backward), its B releases only
    the loss's tensors and W the rest (parallel/pp/split_backward.py keeps the chunk's graph until W); B
    recomputes (`recomputing_in_b`) beside everything, except on the first virtual stage, whose W is whole."""
    split = any(op == WEIGHTS for op, _ in walk)
    # Plain counters, not a dict of readers: the planner walks every rank of thousands of layouts.
    held = peak = inputs = targets = 0
    for op, vstage in walk:
        chunk = chunks[vstage]
        if op == FORWARD:
            held += chunk.per_microbatch
            inputs += chunk.reads_inputs
            targets += chunk.reads_targets
        elif split and op != WEIGHTS:  # B: the first virtual stage's computes nothing
            if vstage:
                peak = max(peak, held + chunk.recomputing_in_b + batch * ((inputs > 0) + (targets > 0)))
            held -= chunk.loss
        else:  # its recomputation peaks after the head's backward (the targets' storage freed with it)
            recomputing = chunk.recomputing if not split or vstage == 0 else 0
            peak = max(peak, held + recomputing + batch * ((inputs > 0) + (targets - chunk.reads_targets > 0)))
            held -= chunk.per_microbatch - (chunk.loss if split else 0)
            inputs -= chunk.reads_inputs
            targets -= chunk.reads_targets
        now = held + batch * ((inputs > 0) + (targets > 0))
        if now > peak:
            peak = now
    return peak


def activation_bytes(model: GPTConfig, layout: Layout) -> list[int] | None:
    """The registry's `activations` formula for single, dp, zero1/2, cp and cp_a2a (one stage, no tp,
    fp32): every rank holds the same, `activation_terms(...)["peak"]`."""
    terms = activation_terms(model, layout) if layout.precision == "fp32" else None
    return None if terms is None else [terms["peak"]] * layout.dims.world_size


def registry_activations(model: GPTConfig, layout: Layout, global_batch: int | None = None,
                         layers: Sequence[int] | None = None,
                         walk: Sequence[Sequence[tuple[bool, int]]] | None = None) -> list[int] | None:
    """The registry's `activations` formula (summary memory.theory.activation_bytes) for this GPT,
    `activation_bytes_by_rank` with the layout's bytes per element. The global batch is
    dp x microbatches x microbatch size. None for a bf16 run: autocast runs the linears in bf16 and
    leaves the residual stream, the norms and the loss in fp32, a mix no formula here derives (the
    planner's bf16 figures are parallel/planner/memory.py's)."""
    if layout.precision != "fp32":
        return None
    if global_batch is None:
        global_batch = layout.dims.dp * layout.microbatches * layout.microbatch_size
    return activation_bytes_by_rank(model, layout, global_batch, layout.dtype_bytes, layers, walk)
