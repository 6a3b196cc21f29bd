"""Memory per rank, in closed form: what autograd saves for backward, and the model state.

Activations: parallel/activations.py's walk (the bytes this GPT's ops save for backward, for any
shape), handed this layout's schedule by parallel/pp/theory.py.

Model state: parameters, gradients and optimizer state per rank (the families' theory.py formulas, for any
`ModelShape`): fp32 training holds 4 + 4 + 8 bytes per parameter; bf16 mixed precision 2 (bf16
weights) + 2 (bf16 gradients) + 12 (fp32 master weights and Adam's two moments), the ZeRO paper's
K = 12. ZeRO stage k shards, over the dp ranks: 1 the optimizer state, 2 also the gradients, 3 also
the parameters.
"""

from __future__ import annotations

from parallel import activations
from parallel.activations import LOSS_BYTES
from parallel.algebra import padded
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.pp.theory import pipeline_walk, stage_layer_counts


def activation_bytes_by_rank(model: GPTConfig | ModelShape, layout: Layout, global_batch: int,
                             act_bytes: int = 4) -> list[int] | None:
    """parallel/activations.py's walk with this layout's schedule (parallel/pp/theory.py)."""
    return activations.activation_bytes_by_rank(model, layout, global_batch, act_bytes,
                                                virtual_stage_layers(model, layout), pipeline_walk(layout))


def virtual_stage_layers(model: GPTConfig | ModelShape, layout: Layout) -> list[int]:
    gpt = model.gpt if isinstance(model, ModelShape) else model
    return stage_layer_counts(gpt.n_layers, layout)


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
