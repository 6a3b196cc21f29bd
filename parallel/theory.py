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


def _figure(totals_by_op: dict[str, tuple[int, Fraction]], ranks: int) -> dict:
    """(payload, sent) per op summed over all ranks -> the summary's expected_comm block."""
    by_op = {
        op: {"payload_bytes": payload, "sent_bytes": float(sent), "sent_bytes_exact": str(sent)}
        for op, (payload, sent) in totals_by_op.items()
    }
    total = sum((sent for _, sent in totals_by_op.values()), Fraction(0))
    return {
        "sent_bytes_per_step": float(total),
        "sent_bytes_per_step_exact": str(total),
        "sent_bytes_per_rank_per_step": float(total / ranks),  # the mean, where ranks differ
        "by_op": by_op,
    }


def pipeline_p2p_bytes(model_cfg: GPTConfig, microbatch_size: int, microbatches: int, stages: int, virtual: int,
                       dtype_bytes: int = FP32_BYTES) -> int:
    """Narayanan §3.2: b·s·h·B per microbatch per stage boundary in each direction, so
    2·m·(v·p-1)·b·s·h·B per step for one pipeline (v = 1 for GPipe and 1F1B)."""
    activation = microbatch_size * model_cfg.seq_len * model_cfg.d_model * dtype_bytes
    return 2 * microbatches * (virtual * stages - 1) * activation


def expected_comm(strategy: str, model_cfg: GPTConfig, dims: ParallelDims, *, global_batch: int = 0,
                  microbatches: int = 1, virtual: int = 1, dtype_bytes: int = FP32_BYTES) -> dict:
    """Strategy traffic per optimizer step, summed over all ranks, in the summary's schema.

    single: nothing crosses between ranks.
    dp (naive, bucketed, torch_ddp): one all-reduce of all gradients per step, 2(N-1)/N · Ψ·B per
    rank, whatever the bucketing and however many microbatches are accumulated.
    pp: every activation and its gradient crosses each boundary once per microbatch (sends; a
    receive sends nothing), in each of the dp pipelines; with dp > 1 each stage then all-reduces
    its own parameters over dp, which sums to 2(dp-1)/dp · Ψ·B per pipeline rank position, i.e.
    2(dp-1) · Ψ·B over all ranks.
    """
    psi = parameter_count(model_cfg)
    if strategy == "single" or dims.world_size == 1:
        return _figure({}, dims.world_size)
    if strategy in ("dp", "torch_ddp"):
        grads = psi * dtype_bytes
        return _figure({"all_reduce": (grads * dims.world_size, all_reduce_sent_per_rank(dims.dp, grads) * dims.world_size)},
                       dims.world_size)
    if strategy == "pp":
        b = global_batch // (dims.dp * microbatches)
        p2p = pipeline_p2p_bytes(model_cfg, b, microbatches, dims.pp, virtual, dtype_bytes) * dims.dp
        totals = {}
        if p2p:
            totals = {"send": (p2p, Fraction(p2p)), "recv": (p2p, Fraction(0))}
        if dims.dp > 1:
            grads = psi * dtype_bytes  # summed over the stages of one pipeline
            totals["all_reduce"] = (grads * dims.dp, all_reduce_sent_per_rank(dims.dp, grads) * dims.dp)
        return _figure(totals, dims.world_size)
    raise ValueError(f"theory has no formula for strategy {strategy!r}")
