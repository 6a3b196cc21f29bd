"""Data parallelism's closed forms: its traffic per step and what every rank holds (docs/theory/).

Like every theory file, independent of the code it checks: Ψ from the GPT formula
(parallel/algebra.py), bytes from the ring's factor, never from the model's tensors or the log.
"""

from __future__ import annotations

from parallel.algebra import all_reduce_sent_per_rank, figure, parameter_count
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.model_state import model_state, run_state_bytes, whole_model_parts


def dp_comm(model: GPTConfig, layout: Layout) -> dict:
    """dp (naive, bucketed), torch_ddp, accelerate_ddp: one all-reduce of all gradients per step,
    2(N-1)/N · Ψ·B per rank, whatever the bucketing and however many microbatches are accumulated."""
    dims, grads = layout.dims, parameter_count(model) * layout.dtype_bytes
    return figure({"all_reduce": (grads * dims.world_size,
                                  all_reduce_sent_per_rank(dims.dp, grads) * dims.world_size)},
                  dims.world_size)


def replicated_model_state_bytes(model: GPTConfig, layout: Layout) -> dict:
    """Plain data parallelism (and one process) holds all of it on every rank: fp32 parameters 4Ψ,
    gradients 4Ψ and Adam's two moments 8Ψ bytes (ZeRO paper §5, with K = 8 for fp32 Adam): every part
    whole (parallel/model_state.py)."""
    return model_state(whole_model_parts(ModelShape(gpt=model)), run_state_bytes(layout.dtype_bytes))
