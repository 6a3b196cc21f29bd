"""Data parallelism's closed forms: its traffic per step and what every rank holds (docs/theory/).

Like every theory file, independent of the code it checks: Ψ from the GPT formula
(parallel/algebra.py), bytes from the ring's factor, never from the model's tensors or the log.
"""

from __future__ import annotations

from parallel.algebra import all_reduce_sent_per_rank, figure, parameter_count, state_figures
from parallel.core.model import GPTConfig
from parallel.layout import Layout


def dp_comm(cfg: GPTConfig, layout: Layout) -> dict:
    """dp (naive, bucketed), torch_ddp, accelerate_ddp: one all-reduce of all gradients per step,
    2(N-1)/N · Ψ·B per rank, whatever the bucketing and however many microbatches are accumulated."""
    dims, grads = layout.dims, parameter_count(cfg) * layout.dtype_bytes
    return figure({"all_reduce": (grads * dims.world_size,
                                  all_reduce_sent_per_rank(dims.dp, grads) * dims.world_size)},
                  dims.world_size)


def replicated_model_state_bytes(cfg: GPTConfig, layout: Layout) -> dict:
    """Plain data parallelism (and one process) holds all of it on every rank: fp32 parameters 4Ψ,
    gradients 4Ψ and Adam's two moments 8Ψ bytes (ZeRO paper §5, with K = 8 for fp32 Adam)."""
    psi = parameter_count(cfg)
    B = layout.dtype_bytes
    return state_figures(psi * B, psi * B, 2 * psi * B, psi)
