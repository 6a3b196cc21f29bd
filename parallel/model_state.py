"""One rank's model state in closed form: the parameters, gradients and optimizer state of the parts
it holds, for any `ModelShape` (the sandbox GPT, or a planner shape such as Llama).

Every model-state formula is this one function applied to what a rank holds: plain data parallelism
all parts, a pipeline stage its blocks and ends (the caller works out which), a tensor-parallel rank
each part cut over tp, an expert-parallel rank E/ep experts of each MoE block; and over how many ranks
ZeRO shards it (dp, or dp·cp where context parallelism replicates the weights too). The families'
theory.py (dp, zero, cp, moe, compose) and the planner (parallel/planner/memory.py) only say that.

Bytes per parameter are (parameters, gradients, optimizer state): a run's (B, B, 2B) with Adam's two
moments in the parameters' dtype (`run_state_bytes`), or the planner's `STATE_BYTES` per precision.
ZeRO stage k pads each part to a multiple of the n ranks it shards over (its flat buffers,
parallel/sync/shards.py) and keeps 1/n of the optimizer state (k >= 1), the gradients (k >= 2) and the
parameters (k = 3) (Rajbhandari et al. 2019, §5). Derivation: docs/theory/memory.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from parallel.algebra import padded, state_figures
from parallel.core.shape import ModelShape

# Bytes per parameter of (parameters, gradients, optimizer state) by training precision: fp32 keeps fp32
# weights, gradients and Adam's two moments; bf16 mixed precision bf16 weights and gradients and, in the
# optimizer, an fp32 master copy with the two moments (ZeRO paper §3.1: 2 + 2 + K, K = 12).
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


def run_state_bytes(dtype_bytes: int) -> tuple[int, int, int]:
    """A run's bytes per parameter: B for the weights and for their gradients, 2B for Adam's moments."""
    return dtype_bytes, dtype_bytes, 2 * dtype_bytes


def mlp_parameters(shape: ModelShape) -> int:
    """One MLP (one expert of an MoE block): gated 2·(h·f + f) + f·h + h, plain (h·f + f) + f·h + h,
    biases only where the shape has them."""
    return shape.mlp_parameters()


def block_parameters(shape: ModelShape, index: int, t: int = 1, ep: int = 1) -> int:
    """Block `index` on one rank: the dense block cut over t tp ranks (`ModelShape.layer_parameters`),
    or an MoE block with E/ep of its E experts in place of the one MLP, and the router's h·E."""
    g = shape.gpt
    if not g.is_moe_block(index):
        return shape.layer_parameters(t)
    if t > 1:
        raise ValueError(f"no model state for a mixture-of-experts block cut over tp={t}: experts are not tp-sharded")
    return shape.layer_parameters() + (g.moe_experts // ep - 1) * mlp_parameters(shape) + g.d_model * g.moe_experts


def rank_parts(shape: ModelShape, blocks: Iterable[int], embedding: bool, head: bool, t: int = 1, ep: int = 1,
               copy_of_tied: bool = False) -> list[int]:
    """The parameters of each part one rank holds, in forward order (ZeRO's unit of padding): the
    embedding if it holds it, each of its `blocks` (their indices), the final norm and head if it holds
    them (`copy_of_tied`: a tied head's copy of the token rows on a pipeline's last stage)."""
    return [*([shape.embedding_parameters(t)] if embedding else []),
            *(block_parameters(shape, i, t, ep) for i in blocks),
            *([shape.head_parameters(t, copy_of_tied)] if head else [])]


def whole_model_parts(shape: ModelShape, t: int = 1, ep: int = 1) -> list[int]:
    """Every part, as a rank that is not pipelined holds them."""
    return rank_parts(shape, range(shape.gpt.n_layers), True, True, t, ep)


def model_state(parts: Sequence[int], bytes_per_parameter: tuple[int, int, int], zero: int = 0,
                shards: int = 1) -> dict:
    """Parameters, gradients and optimizer state of a rank holding `parts`, in bytes (the summary's
    memory.theory.model_state_bytes: `algebra.state_figures`).

    Without ZeRO every part whole: Ψ_r = Σ parts, Ψ_r·(P + G + O) bytes. ZeRO stage k over n = `shards`
    ranks: each part padded to a multiple of n, Ψ_pad = Σ ceil(part / n)·n, and 1/n kept of the
    optimizer state (k >= 1), of the gradients (k >= 2), of the parameters (k = 3):

        zero1  Ψ_pad·(P + G + O/n)     zero2  Ψ_pad·(P + G/n + O/n)     zero3  Ψ_pad·(P + G + O)/n
    """
    count = sum(padded(n, shards) for n in parts) if zero else sum(parts)
    p, g, o = (count * b for b in bytes_per_parameter)
    # Ψ_pad is a multiple of n, so every 1/n below is exact.
    return state_figures(p // (shards if zero >= 3 else 1), g // (shards if zero >= 2 else 1),
                         o // (shards if zero >= 1 else 1), count)
