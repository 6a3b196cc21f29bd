"""Closed-form figures every run is checked against (formulas from REFERENCES.md).

Deliberately independent of the code it checks: parameter counts come from the GPT formula, not
from summing the model's tensors, and bytes from the per-strategy formulas, not from the
communication log's per-call arithmetic. Bytes are exact Fractions so that a test can assert
equality to the byte.
"""

from __future__ import annotations

from fractions import Fraction

from .dims import ParallelDims
from .model import GPTConfig

FP32_BYTES = 4


def parameter_count(cfg: GPTConfig) -> int:
    """Ψ = V·h + s·h + L·(12h² + 13h) + 2h + V·h (untied head), V the padded vocabulary.

    Per layer: Q, K, V and output projections 4h² + 4h, MLP 8h² + 5h (fc with bias 4h, proj with
    bias h), two LayerNorms 4h. The final LayerNorm adds 2h; the untied head V·h (no bias).
    """
    V, h, s, L = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers
    # The formula assumes the MLP is 4h wide; a different ratio changes the 12h² + 13h term.
    mlp = 2 * cfg.mlp_ratio * h * h + cfg.mlp_ratio * h + h
    per_layer = 4 * h * h + 4 * h + mlp + 4 * h
    return V * h + s * h + L * per_layer + 2 * h + V * h


def all_reduce_sent_per_rank(n: int, payload_bytes: int) -> Fraction:
    return Fraction(2 * (n - 1), n) * payload_bytes if n > 1 else Fraction(0)


def _figure(per_rank_by_op: dict[str, tuple[int, Fraction]], ranks: int) -> dict:
    """Per-rank (payload, sent) per op -> the summary's expected_comm block (summed over ranks)."""
    by_op = {
        op: {"payload_bytes": payload * ranks, "sent_bytes": float(sent * ranks), "sent_bytes_exact": str(sent * ranks)}
        for op, (payload, sent) in per_rank_by_op.items()
    }
    per_rank = sum((sent for _, sent in per_rank_by_op.values()), Fraction(0))
    return {
        "sent_bytes_per_step": float(per_rank * ranks),
        "sent_bytes_per_step_exact": str(per_rank * ranks),
        "sent_bytes_per_rank_per_step": float(per_rank),
        "by_op": by_op,
    }


def expected_comm(strategy: str, model_cfg: GPTConfig, dims: ParallelDims, dtype_bytes: int = FP32_BYTES) -> dict:
    """Strategy traffic per optimizer step, in the summary's schema.

    single: nothing crosses between ranks.
    dp (naive, bucketed, torch_ddp): one all-reduce of all gradients per step, 2(N-1)/N · Ψ·B per
    rank, whatever the bucketing and however many microbatches are accumulated.
    """
    psi = parameter_count(model_cfg)
    if strategy == "single" or dims.world_size == 1:
        return _figure({}, dims.world_size)
    if strategy in ("dp", "torch_ddp"):
        grads = psi * dtype_bytes
        return _figure({"all_reduce": (grads, all_reduce_sent_per_rank(dims.dp, grads))}, dims.world_size)
    raise ValueError(f"theory has no formula for strategy {strategy!r}")
