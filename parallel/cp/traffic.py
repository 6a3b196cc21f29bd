"""Bytes one context-parallel rank sends, per attention layer and microbatch: pure functions.

Notation (docs/theory/context.md): b microbatch size, s full sequence length, a the heads this
rank's attention holds (n_heads, or n_heads / tp under tensor parallelism), d head dim, cp the
context-parallel degree, B bytes per activation element (4 in fp32, 2 under bf16 autocast).
A rank holds s/cp tokens, so its K (or V) is b·a·(s/cp)·d elements.

Ring (parallel/cp/ring.py), `send` calls on the cp group:
    forward   cp − 1 sends of K and V:                           (cp − 1)·2·b·a·(s/cp)·d·B
    backward  cp − 1 sends of K and V, cp − 1 of the dK, dV      (cp − 1)·2·b·a·(s/cp)·d·(B + max(B, 4))
              accumulator (fp32, or wider activations' dtype)
All-to-all (parallel/cp/ulysses.py), `all_to_all` calls, each sending (cp − 1)/cp of its input:
    forward   Q, K, V stacked (3 units) and the output (1 unit)  (cp − 1)/cp·4·b·a·(s/cp)·d·B
    backward  the same two, reversed                              (cp − 1)/cp·4·b·a·(s/cp)·d·B
Every figure is what the communication log's `sent` column adds up to, to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from parallel.cp.layout import check_divisible

FP32_BYTES = 4  # the ring's gradient accumulator is never narrower than fp32


@dataclass(frozen=True)
class LayerTraffic:
    """One attention layer, one microbatch, one rank: calls that send and the bytes they send."""

    op: str  # "send" (ring) or "all_to_all"
    fwd_calls: int
    fwd_sent: Fraction
    bwd_calls: int
    bwd_sent: Fraction

    @property
    def sent(self) -> Fraction:
        return self.fwd_sent + self.bwd_sent


def local_kv_elements(batch: int, seq_len: int, heads: int, head_dim: int, cp: int) -> int:
    """Elements of one of K or V on one rank: b·a·(s/cp)·d."""
    check_divisible(seq_len, cp)
    return batch * heads * (seq_len // cp) * head_dim


def ring_layer_traffic(batch: int, seq_len: int, heads: int, head_dim: int, cp: int, dtype_bytes: int) -> LayerTraffic:
    kv = 2 * local_kv_elements(batch, seq_len, heads, head_dim, cp)  # K and V travel together
    hops = cp - 1
    return LayerTraffic(
        op="send",
        fwd_calls=hops, fwd_sent=Fraction(hops * kv * dtype_bytes),
        bwd_calls=2 * hops, bwd_sent=Fraction(hops * kv * (dtype_bytes + max(dtype_bytes, FP32_BYTES))),
    )


def ulysses_layer_traffic(batch: int, seq_len: int, heads: int, head_dim: int, cp: int,
                          dtype_bytes: int) -> LayerTraffic:
    units = 4 * local_kv_elements(batch, seq_len, heads, head_dim, cp) * dtype_bytes  # q, k, v and the output
    per_direction = Fraction(cp - 1, cp) * units  # 0 for a group of one, whose two calls move nothing
    return LayerTraffic(op="all_to_all", fwd_calls=2, fwd_sent=per_direction, bwd_calls=2, bwd_sent=per_direction)


def step_sent(layer: LayerTraffic, n_layers: int, microbatches: int) -> Fraction:
    """Bytes one cp rank sends for attention in one optimizer step: every layer, every microbatch,
    forward and backward (the cp group's only traffic; gradient sync over cp is the dp's business)."""
    return layer.sent * n_layers * microbatches
