"""Compute time of one microbatch on one rank: a roofline per GEMM, and the elementwise ops at HBM speed.

Each block's forward is its GEMMs (m x n x k, a batch of them for attention):

    qkv     b·s x (h + 2·h_kv)/t x h        proj    b·s x h x h/t
    mlp up  b·s x (1 or 2)·f/t x h          mlp dn  b·s x h x f/t
    scores  (b·a/t) x [s x s x d_head]      values  (b·a/t) x [s x d_head x s]   (no causal skipping,
                                                    as Megatron's count 96·B·s·l·h²(1 + s/6h) has it)
    head    b·s x V/t x h                   (the last stage)

A GEMM takes max(2·m·n·k / (peak x efficiency x wave), bytes / HBM): bytes its two inputs and its
output at the activation width; `wave` is the share of the device's SMs its output tiles keep busy
in their last wave (tiles of tile_m x tile_n over `sms`; NVIDIA, "Matrix Multiplication Background
User's Guide", Deep Learning Performance docs: wave quantization), so small or oddly sized GEMMs run
below the peak and large ones at `efficiency` of it. The elementwise ops (norms, activation function,
dropout, residual adds, softmax statistics) are memory-bound: the bytes they read and write, per
block, `elementwise_units` x b·s·h (x the activation width, over t where sequence parallelism or tp
cuts them), at HBM speed.

Backward costs twice the forward (the input- and the weight-gradient GEMMs of every forward GEMM).
Recomputation adds hardware FLOPs, not model FLOPs: full recomputation one more forward of every
block in backward, selective one more forward of every attention core (scores and values).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from parallel.core.shape import ModelShape


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    def bytes(self, width: int) -> float:
        return float(width) * (self.m * self.k + self.k * self.n + self.m * self.n) * self.batch


@dataclass(frozen=True)
class Device:
    """What the roofline reads from a cluster: dense peak, the GEMM efficiency of a full wave, HBM, the SMs."""

    peak_flops: float
    efficiency: float
    hbm_bytes_per_s: float
    sms: int
    tile: tuple[int, int] = (256, 128)

    def wave(self, g: Gemm) -> float:
        tiles = ceil(g.m / self.tile[0]) * ceil(g.n / self.tile[1]) * g.batch
        return tiles / (ceil(tiles / self.sms) * self.sms)

    def seconds(self, g: Gemm, width: int) -> float:
        return max(g.flops / (self.peak_flops * self.efficiency * self.wave(g)), g.bytes(width) / self.hbm_bytes_per_s)


def block_gemms(shape: ModelShape, t: int, b: int) -> dict[str, list[Gemm]]:
    g = shape.gpt
    s, h, n = g.seq_len, g.d_model, b * g.seq_len
    up = (2 if shape.gated_mlp else 1) * shape.ffn
    return {
        "matmuls": [Gemm(n, (h + 2 * shape.kv_width) // t, h), Gemm(n, h, h // t), Gemm(n, up // t, h),
                    Gemm(n, h, shape.ffn // t)],
        "attention": [Gemm(s, s, g.head_dim, b * g.n_heads // t), Gemm(s, g.head_dim, s, b * g.n_heads // t)],
    }


ELEMENTWISE_UNITS = 2 * 34  # b·s·h elements read and written per block forward (Korthikanti et al.'s 34 saved, twice)


def microbatch_seconds(shape: ModelShape, device: Device, t: int, b: int, layers: int, last: bool, width: int,
                       sequence_parallel: bool, recompute: str = "none") -> dict:
    """Forward and backward seconds of one microbatch on a rank holding `layers` blocks (and the head if
    `last`), split into matmuls, attention and elementwise; and its hardware and model FLOPs."""
    g = shape.gpt
    gemms = block_gemms(shape, t, b)
    matmul = sum(device.seconds(x, width) for x in gemms["matmuls"])
    attention = sum(device.seconds(x, width) for x in gemms["attention"])
    # Without sequence parallelism the norms and dropouts (10 of the 34 units) run whole on every tp rank.
    cut = 34 / t if sequence_parallel else 10 + 24 / t
    elementwise = 2 * cut * b * g.seq_len * g.d_model * width / device.hbm_bytes_per_s
    head = Gemm(b * g.seq_len, g.padded_vocab_size // t, g.d_model)
    head_s = device.seconds(head, width) if last else 0.0
    forward = layers * (matmul + attention + elementwise) + head_s
    block_flops = sum(x.flops for x in gemms["matmuls"]) + sum(x.flops for x in gemms["attention"])
    model_flops = 3 * (layers * block_flops + (head.flops if last else 0.0))
    extra_s, extra_flops = 0.0, 0.0
    if recompute == "full":
        extra_s, extra_flops = layers * (matmul + attention + elementwise), layers * block_flops
    elif recompute == "selective":
        extra_s, extra_flops = layers * attention, layers * sum(x.flops for x in gemms["attention"])
    return {"forward": forward, "backward": 2 * forward + extra_s, "recompute": extra_s,
            "matmuls": 3 * layers * matmul + (3 * head_s), "attention": 3 * layers * attention,
            "elementwise": 3 * layers * elementwise, "model_flops": model_flops,
            "hardware_flops": model_flops + extra_flops}
