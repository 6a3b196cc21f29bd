"""Memory per rank, in closed form: what autograd saves for backward, the model state, and the
transient buffers beside them at the peak.

Activations: parallel/activations.py's walk (the bytes this GPT's ops save for backward, for any
shape), handed this layout's schedule by parallel/pp/theory.py.

Model state: parallel/model_state.py's one formula, told what a rank holds (its stage's blocks and
ends by the schedule's placement, cut over tp, E/ep experts per MoE block) and over how many ranks
ZeRO shards it, at `STATE_BYTES[precision]` per parameter: fp32 4 + 4 + 8, bf16 mixed precision
2 + 2 + 12 (the ZeRO paper's K = 12).
"""

from __future__ import annotations

from functools import lru_cache

from parallel import activations
from parallel.activations import LOSS_BYTES
from parallel.algebra import padded
from parallel.compose import theory as compose_theory
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.model_state import STATE_BYTES, model_state, rank_parts
from parallel.planner.moe import moe_units_delta
from parallel.planner.remedies import zero_shards


def activation_bytes_by_rank(model: GPTConfig | ModelShape, layout: Layout, global_batch: int,
                             act_bytes: int = 4) -> list[int] | None:
    """parallel/activations.py's walk with this layout's schedule (the recipe's, parallel/compose/theory.py)."""
    return activations.activation_bytes_by_rank(model, layout, global_batch, act_bytes,
                                                virtual_stage_layers(model, layout),
                                                compose_theory.schedule_walk(layout))


def virtual_stage_layers(model: GPTConfig | ModelShape, layout: Layout) -> list[int]:
    gpt = model.gpt if isinstance(model, ModelShape) else model
    return compose_theory.virtual_stage_layers(gpt.n_layers, layout)


# -- model state ----------------------------------------------------------------------------------------
def rank_layers(shape: ModelShape, layout: Layout) -> list[int]:
    """Blocks each pipeline rank holds over its chunks, by the schedule's placement (compose.theory.stage_layers)."""
    return compose_theory.layers_by_stage(shape.gpt, layout)


@lru_cache(maxsize=4096)
def _placed(gpt: GPTConfig, dims, options) -> tuple:
    """compose.theory's blocks and ends of every stage, once per layout shape (the planner asks for each
    stage of thousands of layouts, and each answer computes every stage's)."""
    return compose_theory.placement_by_stage(gpt, Layout(dims=dims, options=options))


def _placement(shape: ModelShape, layout: Layout) -> tuple:
    return _placed(shape.gpt, layout.dims, layout.options)


def stage_parts(shape: ModelShape, layout: Layout, pp_rank: int) -> list[int]:
    """One rank's parts (ZeRO's unit of sharding: embedding, each block, head) on stage `pp_rank`, each cut
    over tp, its MoE blocks with E/ep experts: which blocks and ends it holds is the schedule's placement
    (compose.theory.stage_blocks and stage_ends); a tied head's last stage keeps a copy of the token rows."""
    dims = layout.dims
    stage_blocks, stage_ends = _placement(shape, layout)
    blocks, (first, last) = stage_blocks[pp_rank], stage_ends[pp_rank]
    return rank_parts(shape, blocks, first, last, dims.tp, dims.ep, copy_of_tied=dims.pp > 1)


def model_state_bytes(shape: ModelShape, layout: Layout, zero: int, precision: str, pp_rank: int,
                      outer: int = 0) -> dict:
    """Parameters, gradients and optimizer state on one rank of stage `pp_rank`: parallel/model_state.py's
    `model_state` of its `stage_parts`, at `STATE_BYTES[precision]` per parameter, ZeRO stage `zero`
    sharding over the ranks that replicate them (dp, or dp·cp; a shard group's dp_shard under hybrid
    sharding), and `outer` bytes per parameter more with the optimizer's (DiLoCo's outer state:
    remedies.py). The families' formulas for the GPT in fp32."""
    parts = stage_parts(shape, layout, pp_rank)
    state = model_state(parts, STATE_BYTES[precision], zero, zero_shards(layout.dims))
    return {"params": state["param_bytes"], "grads": state["grad_bytes"],
            "optimizer": state["optimizer_bytes"] + outer * sum(parts),
            "parameters_counted": state["parameters_counted"]}


def buffer_bytes(shape: ModelShape, layout: Layout, zero: int, precision: str, pp_rank: int) -> int:
    """Transient tensors beside the saved activations at the peak, on one rank of stage `pp_rank`:

    * the last stage's logits, n·V/t in fp32, n this rank's b·s/cp tokens (alive next to the saved
      log-probabilities until the
      loss has read them; the same size again as their gradient in backward);
    * a tp region's summed output, n·h·B (the all-reduce works on a copy);
    * ZeRO-3: one part's gathered parameters and its full gradient before the reduce-scatter;
      ZeRO-2: one part's full gradient before the reduce-scatter (the largest part's).
    """
    g = shape.gpt
    t, d = layout.dims.tp, zero_shards(layout.dims)
    param_b, grad_b, _ = STATE_BYTES[precision]
    act_b = 4 if precision == "fp32" else 2
    n = layout.rank_tokens(g.seq_len)
    _, last = _placement(shape, layout)[1][pp_rank]
    total = n * g.padded_vocab_size // t * LOSS_BYTES if last else 0
    if t > 1:
        total += n * g.d_model * act_b
    if zero >= 2:
        largest = padded(max(stage_parts(shape, layout, pp_rank)), d)
        total += largest * grad_b + (largest * param_b if zero >= 3 else 0)
    return total


# -- activations as Megatron-style implementations hold them (cluster shapes, bf16) ------------------------
def block_units(shape: ModelShape, t: int, sequence_parallel: bool, act_bytes: int, saves_shard: bool = False,
                flash_attention: bool = True) -> dict[str, float]:
    """Bytes one block saves for backward per token of a microbatch (Korthikanti et al. 2022, §4), each
    term over t where tp or sequence parallelism cuts it:

        norm inputs 2·w·h (over t with sp), the QKV and MLP GEMMs' inputs 2·w·h (over t with sp when the
        column-parallel linears save the sequence piece, `Cut.saves_shard`; whole otherwise: the
        gathered input, parallel/activations.py's `column_input`), Q, K, V w·(h/t + 2·h_kv,t) (h_kv,t: this
        rank's K/V heads' width, `ModelShape.kv_width_per_rank`), the output
        projection's input w·h/t, the MLP's up output(s) and the activation function's output
        w·(2 or 3)·f/t, and with dropout two masks of h bytes (over t with sp);
        materialized attention (`flash_attention` false) also its s x s `scores` per head: the softmax's
        output w·a·s/t and, with dropout, the attention dropout's 1-byte mask and output (1 + w)·a·s/t.
        Flash attention holds nothing of size s² (it recomputes the scores in backward).

    For a GPT (h_kv = h, f = 4h, dropout, w = 2, materialized) this is their Table 2: sbh·(10 + 24/t +
    5as/(ht)) without sp, sbh·(34 + 5as/h)/t with sp and sharded saving (Megatron's); sp saving the
    gathered inputs holds 4 + 30/t units instead of 34/t. `input` is a block's input alone (what full
    recomputation keeps); `before_core` what a block still holds when its attention core reruns in
    backward (ln1's input, the QKV GEMM's input, Q, K, V: the MLP's and the output projection's saved
    tensors are freed by then)."""
    g = shape.gpt
    h, f, w = g.d_model, shape.ffn, act_bytes
    cut = t if sequence_parallel else 1
    mask = 1 if g.dropout else 0
    gemm_input = w * h / (t if sequence_parallel and saves_shard else 1)
    # K and V: h_kv/t per rank, or one head's width where t exceeds grouped-query attention's kv heads
    # (each replicated); multi-head attention's cut as Q's is, whatever t (a planner shape's algebra).
    kv = shape.kv_width_per_rank(t) if shape.kv_heads < min(t, g.n_heads) else shape.kv_width / t
    qkv = w * (h / t + 2 * kv)
    whole = (2 * w * h + 2 * mask * h) / cut + 2 * gemm_input
    sharded = qkv + w * h / t + w * (3 if shape.gated_mlp else 2) * f / t
    scores = 0 if flash_attention else (w + mask * (1 + w)) * g.n_heads * g.seq_len / t
    # A mixture of experts: its MoE blocks' router, permuted rows and experts in place of the MLP (moe.py).
    sharded += moe_units_delta(shape, t, act_bytes)
    return {"layer": whole + sharded + scores, "input": w * h / cut, "scores": scores,
            "before_core": w * h / cut + gemm_input + qkv}


def block_saves(shape: ModelShape, layout: Layout, act_bytes: int, flash_attention: bool = True) -> tuple:
    """(tokens, kept, working, in_b): a microbatch's tokens on a rank, the bytes each block keeps per token
    through the step under the layout's recompute mode (`implementation_activation_bytes` says what
    each mode keeps), the bytes the block being recomputed holds beside them in a whole backward, and in a
    split backward's B, which frees nothing of the chunk before W: the recomputed set whole (full: the
    block less its input; selective: the core's scores)."""
    cut = layout.cut()
    units = block_units(shape, layout.dims.tp, cut.sequence_parallel, act_bytes, cut.saves_shard, flash_attention)
    tokens = layout.rank_tokens(shape.gpt.seq_len)
    mode = layout.recompute or "none"
    if mode == "full":
        kept, working = units["input"], units["layer"] - units["input"]
        in_b = working
    elif mode == "selective":
        kept = units["layer"] - units["scores"]
        working, in_b = max(0.0, units["before_core"] + units["scores"] - kept), units["scores"]
    else:
        kept, working, in_b = units["layer"], 0.0, 0.0
    return tokens, kept, working * tokens, in_b * tokens


def implementation_activation_bytes(shape: ModelShape, layout: Layout, act_bytes: int,
                                    flash_attention: bool = True) -> list[int]:
    """Saved bytes at the step's peak on every rank, as a Megatron-style implementation holds them
    (`block_units` per block and token; the embedding's and head's small saved tensors left out, the
    logits being a buffer). Every block's kept tensors of every microbatch in flight, plus, in backward,
    the one block being recomputed:

      none       every block's whole set
      selective  every block's set less the materialized core's scores; while a core reruns in backward,
                 its scores beside what that block still holds (`before_core`): nothing recomputed under
                 flash attention, which saves no scores
      full       each block's input, and one block's whole set while it is recomputed

    Microbatches in flight per rank: the schedule's own walk (parallel/pp/theory.py), as for the
    sandbox's formulas; under a split backward B recomputes beside everything the chunk saved (its graph
    is kept for W), the first virtual stage excepted, whose W is a whole backward."""
    dims = layout.dims
    tokens, kept, working, in_b = block_saves(shape, layout, act_bytes, flash_attention)
    layers = virtual_stage_layers(shape, layout)
    if dims.pp == 1:
        peaks = [int(tokens * kept * layers[0]) + int(working)]
    else:
        # The recomputed block lives in a backward, beside the chunks still in flight (the sandbox's walk too).
        chunks = [activations.ChunkBytes(int(tokens * kept * n), False, False, int(working),
                                         recomputing_in_b=int(in_b) if n else 0) for n in layers]
        walk = compose_theory.schedule_walk(layout)
        peaks = [activations.peak_in_flight(walk[r], chunks, 0) for r in range(dims.pp)]
    # pp is the outermost mesh dimension (dims.MESH_DIMS): each stage's ranks follow one another.
    per_stage = dims.world_size // dims.pp
    return [peak for peak in peaks for _ in range(per_stage)]
