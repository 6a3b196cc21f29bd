"""Data parallelism's closed forms: its traffic per step and what every rank holds (docs/theory/).

Like every theory file, independent of the code it checks: Ψ from the GPT formula
(parallel/algebra.py), bytes from the ring's factor, never from the model's tensors or the log.
"""

from __future__ import annotations

from parallel.algebra import (
    BLOCK_SCALED,
    ELEMENT_BYTES,
    all_ranks,
    all_reduce_sent_per_rank,
    figure,
    gather_or_scatter_sent_per_rank,
    parameter_count,
    scattered_part_bytes,
)
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.model_state import model_state, run_state_bytes, whole_model_parts
from parallel.sync.options import SyncOptions


def dp_comm(model: GPTConfig, layout: Layout) -> dict:
    """dp (naive, bucketed), torch_ddp, accelerate_ddp: one all-reduce of all gradients per step,
    2(N-1)/N · Ψ·B per rank, whatever the bucketing and however many microbatches are accumulated.

    In parallel.comm_dtype: bf16 all-reduces Ψ·2 bytes, 2(N-1)/N of them sent per rank (torch_ddp's
    bf16 hook too). int8 and fp8 quantize each model part (their buckets) in N chunks of
    padded(Ψ_part, N)/N elements, each chunk its bytes and a 4-byte scale per block of 256: an
    all-to-all of W = Σ_parts N·wire(padded/N) bytes (the reduce-scatter), then an all-gather of
    the same W (the reduced chunks), each sending (N-1)/N·W per rank."""
    dims, fmt = layout.dims, layout.of(SyncOptions).comm_dtype
    if fmt in BLOCK_SCALED:
        wire = scattered_part_bytes(model, dims.dp, fmt)
        sent = gather_or_scatter_sent_per_rank(dims.dp, wire)
        return figure(all_ranks({"all_to_all": (wire, sent), "all_gather": (wire, sent)}, dims.world_size),
                      dims.world_size)
    grads = parameter_count(model) * (layout.dtype_bytes if fmt == "fp32" else ELEMENT_BYTES[fmt])
    return figure({"all_reduce": (grads * dims.world_size,
                                  all_reduce_sent_per_rank(dims.dp, grads) * dims.world_size)},
                  dims.world_size)


def replicated_model_state_bytes(model: GPTConfig, layout: Layout) -> dict:
    """Plain data parallelism (and one process) holds all of it on every rank: fp32 parameters 4Ψ,
    gradients 4Ψ and Adam's two moments 8Ψ bytes (ZeRO paper §5, with K = 8 for fp32 Adam): every part
    whole (parallel/model_state.py)."""
    return model_state(whole_model_parts(ModelShape(gpt=model)), run_state_bytes(layout.dtype_bytes))
