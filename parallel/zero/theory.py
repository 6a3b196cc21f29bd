"""ZeRO's closed forms: its traffic per step and the model state each rank keeps (docs/theory/).

Like every theory file, independent of the code it checks: the padded count Ψ_pad comes from the
GPT's parts in closed form (parallel/algebra.py), not from the flat buffers sync/shards.py builds.
"""

from __future__ import annotations

from fractions import Fraction

from parallel.algebra import (
    BLOCK_SCALED,
    all_ranks,
    figure,
    gather_or_scatter_sent_per_rank,
    scattered_part_bytes,
    zero_padded_parameter_count,
)
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.model_state import model_state, run_state_bytes, whole_model_parts
from parallel.sync.options import SyncOptions


def zero_comm(model: GPTConfig, layout: Layout, stage: int) -> dict:
    """ZeRO over N = dp ranks (Rajbhandari et al. §7), on the padded flat buffers (Ψ_pad·B bytes
    of gradients G and of parameters P); a reduce-scatter or all-gather of S bytes sends
    (N-1)/N·S per rank:

      zero1   G reduce-scattered once per step, P all-gathered after the step: (N-1)/N·(G + P)
      zero2   each microbatch's G reduce-scattered as its parts finish backward, P all-gathered
              after the step: (N-1)/N·(m·G + P); with m = 1 the paper's (N-1)/N·(G + P)
      zero3   per microbatch, P all-gathered before forward and again before backward, G
              reduce-scattered: m·(N-1)/N·(2P + G)

    In parallel.comm_dtype, G (and zero3's P) become W = Σ_parts N·wire(Ψ_part,pad/N): Ψ_pad·2 for
    bf16; for int8 and fp8 each part's N chunks with a 4-byte scale per block of 256, and the
    reduce-scatter an all-to-all of those bytes (the reduction is done by the receiver). ZeRO-1/2
    gather the updated parameters in fp32 (their gathered copy is the one they train).
    """
    n = layout.dims.dp
    ranks = layout.dims.world_size
    return figure(all_ranks(zero_per_rank(model, layout, stage, n), ranks), ranks,
                  extra={"padded_parameters": zero_padded_parameter_count(model, n)})


def zero_per_rank(model: GPTConfig, layout: Layout, stage: int, n: int) -> dict[str, tuple[int, Fraction]]:
    """(payload, sent) per op of one rank of ZeRO stage `stage` over a group of n ranks (zero_comm's
    forms; HSDP's shard group, parallel/zero/hsdp_theory.py, is such a group)."""
    m = layout.microbatches
    size = zero_padded_parameter_count(model, n) * layout.dtype_bytes
    fmt = layout.of(SyncOptions).comm_dtype
    wire = size if fmt == "fp32" else scattered_part_bytes(model, n, fmt)
    gathers, scatters = {1: (1, 1), 2: (1, m), 3: (2 * m, m)}[stage]
    scatter_op = "all_to_all" if fmt in BLOCK_SCALED else "reduce_scatter"
    return {op: (payload, gather_or_scatter_sent_per_rank(n, payload))
            for op, payload in (("all_gather", gathers * (wire if stage == 3 else size)),
                                (scatter_op, scatters * wire))}


def zero_model_state_bytes(model: GPTConfig, layout: Layout, stage: int) -> dict:
    """ZeRO over the N dp ranks (Rajbhandari et al. 2019, §5): stage 1 shards Adam's state, stage 2
    also the gradients, stage 3 also the parameters, each on the padded count Ψ_pad:

        zero1  4Ψ + 4Ψ + 8Ψ/N     zero2  4Ψ + 4Ψ/N + 8Ψ/N     zero3  (4Ψ + 4Ψ + 8Ψ)/N   (Ψ = Ψ_pad)

    every part held, sharded over the dp ranks (parallel/model_state.py).
    """
    return zero_state_over(model, layout, stage, layout.dims.dp)


def zero_state_over(model: GPTConfig, layout: Layout, stage: int, n: int) -> dict:
    """The model state per rank of ZeRO stage `stage` sharded over n ranks (n = dp, or HSDP's dp_shard)."""
    return model_state(whole_model_parts(ModelShape(gpt=model)), run_state_bytes(layout.dtype_bytes), stage, n)
