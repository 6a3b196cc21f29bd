"""Compute time of one microbatch on one rank: a roofline per GEMM, and the elementwise ops at HBM speed.

Each block's forward is its GEMMs (m x n x k, a batch of them for attention):

    qkv     b·s x (h + 2·h_kv)/t x h        proj    b·s x h x h/t
    mlp up  b·s x (1 or 2)·f/t x h          mlp dn  b·s x h x f/t
    scores  (b·a/t) x [s x s x d_head]      values  (b·a/t) x [s x d_head x s]   (no causal skipping,
                                                    as Megatron's count 96·B·s·l·h²(1 + s/6h) has it)
    head    b·s x V/t x h                   (the last stage)

Under context parallelism (c = cp) a rank holds b·s/c of the tokens: every GEMM but attention's has
b·s/c rows, and attention is this rank's s/c queries against all s keys (ring: the K and V blocks
come round) or, after the all-to-all, all s queries of a/(t·c) heads (a2a, Ulysses): the same FLOPs.

A GEMM takes max(2·m·n·k / (peak x efficiency x wave x depth), bytes / HBM): bytes its two inputs and
its output at the activation width; `wave` is the share of the device's SMs its output tiles keep busy
in their last wave (tiles of tile_m x tile_n over `sms`; NVIDIA, "Matrix Multiplication Background
User's Guide", Deep Learning Performance docs: wave quantization), so small or oddly sized GEMMs run
below the peak; `depth` = k / (k + k0) is the share of a tile's time spent in its k-loop: besides
the loop, each tile fills its pipeline (stages - 1 k-tiles of tile_m + tile_n rows) and writes its
tile_m x tile_n outputs, at its SM's share of HBM bandwidth, which costs as long as k0 steps of the
loop at the SM's peak (`Device.k0`; docs/theory/planner.md), so shallow GEMMs (small k) run further
below it. A large, deep GEMM runs at `efficiency` of the peak. The elementwise ops between the GEMMs are
memory-bound: the bytes each fused kernel reads and writes, at HBM speed (`elementwise_bytes`, per op,
as Megatron-LM runs them: fused layer norm, fused scale-mask-softmax, fused bias-GeLU, fused
bias-dropout-add; docs/theory/planner.md derives each term).

Backward costs twice the forward's GEMMs (the input- and the weight-gradient GEMM of every forward
GEMM) plus the backward kernels of the elementwise ops (their own bytes, `elementwise_bytes`).
Recomputation adds hardware FLOPs, not model FLOPs: full recomputation one more forward of every
block in backward, selective one more forward of every attention core (scores, softmax and values).
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
    k0: float = 0.0  # a tile's fixed work (pipeline fill, epilogue) in steps of its k-loop; 0 where overlapped
    flash_attention: bool = True  # the attention core one fused kernel (no s x s scores in HBM), else materialized

    def wave(self, g: Gemm) -> float:
        tiles = ceil(g.m / self.tile[0]) * ceil(g.n / self.tile[1]) * g.batch
        return tiles / (ceil(tiles / self.sms) * self.sms)

    def seconds(self, g: Gemm, width: int) -> float:
        return max(self.compute_seconds(g), g.bytes(width) / self.hbm_bytes_per_s)

    def compute_seconds(self, g: Gemm) -> float:
        depth = g.k / (g.k + self.k0)
        return g.flops / (self.peak_flops * self.efficiency * self.wave(g) * depth)

    def attention_seconds(self, scores: Gemm, values: Gemm, width: int) -> float:
        """The attention core's two batched GEMMs. Materialized (Megatron of 2021), each its own roofline, the
        s x s scores written and read in HBM; fused (flash attention, Dao et al. 2022), the scores stay on
        chip: the kernel reads Q, K, V and writes the output, 4·s·d_head per head."""
        if not self.flash_attention:
            return self.seconds(scores, width) + self.seconds(values, width)
        moved = 4.0 * scores.m * scores.k * scores.batch * width
        return max(self.compute_seconds(scores) + self.compute_seconds(values), moved / self.hbm_bytes_per_s)


def tile_fixed_steps(peak_flops: float, hbm_bytes_per_s: float, sms: int, tile: tuple[int, int], k_tile: int,
                     stages: int, width: int = 2) -> float:
    """k0: a tile's pipeline fill ((stages - 1)·k_tile·(tile_m + tile_n) elements read) and epilogue
    (tile_m·tile_n written), at one SM's share of HBM bandwidth, in steps of its k-loop at one SM's
    peak (2·tile_m·tile_n FLOPs a step): ((stages-1)·k_tile·(tm+tn) + tm·tn)·width·peak / (2·tm·tn·HBM)."""
    tm, tn = tile
    moved = ((stages - 1) * k_tile * (tm + tn) + tm * tn) * width / (hbm_bytes_per_s / sms)
    step = 2 * tm * tn / (peak_flops / sms)
    return moved / step


def block_gemms(shape: ModelShape, t: int, b: int, cp: int = 1, cp_kind: str = "ring") -> dict[str, list[Gemm]]:
    g = shape.gpt
    s, h, n = g.seq_len, g.d_model, b * g.seq_len // cp
    up = (2 if shape.gated_mlp else 1) * shape.ffn
    queries, heads = (s, b * g.n_heads // (t * cp)) if cp_kind == "a2a" else (s // cp, b * g.n_heads // t)
    return {
        "matmuls": [Gemm(n, (h + 2 * shape.kv_width) // t, h), Gemm(n, h, h // t), Gemm(n, up // t, h),
                    Gemm(n, h, shape.ffn // t)],
        "attention": [Gemm(queries, s, g.head_dim, heads), Gemm(queries, g.head_dim, s, heads)],
    }


def elementwise_bytes(shape: ModelShape, t: int, b: int, sequence_parallel: bool, width: int,
                      flash_attention: bool = False, cp: int = 1) -> dict[str, float]:
    """Bytes the elementwise kernels of one block read and write, forward and backward, on one tp rank
    (per op, in elements per token; x b·s/cp tokens x `width`; docs/theory/planner.md):

        forward                                        backward
        2 norms         read x, write y: 2·h each       read dy and x, write dx: 3·h each
        2 residual adds fused with the branch's bias     the branch's dx (bias grad from the same read):
                        and dropout: read 2, write 1:    read 1, write 1: 2·h each; the residual's grads
                        3·h each (+ a 1-byte mask)       summed: read 2, write 1: 3·h each
        activation      GeLU(x + bias): read f, write f  read dy and x, write dx: 3·f
                        SwiGLU: read 2·f, write f        read dy, gate, up, write 2: 5·f
        softmax         read and write the scores:       read dy and y, write dx: 3·a·s
                        2·a·s (a/t heads, scaled, masked)

    The norms and residual adds run whole on every tp rank unless sequence parallelism cuts them over t;
    the MLP's and attention's over t always. With flash attention the softmax is inside the attention
    kernel (`Device.attention_seconds`): no softmax bytes here."""
    g = shape.gpt
    h, f, a, s = g.d_model, shape.ffn, g.n_heads, g.seq_len
    cut = t if sequence_parallel else 1
    mask = (h / width if g.dropout else 0.0) / cut  # a 1-byte keep mask per element, in units of `width`
    act_fwd, act_bwd = (3 * f, 5 * f) if shape.gated_mlp else (2 * f, 3 * f)
    a = 0 if flash_attention else a
    forward = (2 * 2 * h + 2 * 3 * h) / cut + 2 * mask + (act_fwd + 2 * a * s) / t
    backward = (2 * 3 * h + 2 * 2 * h + 2 * 3 * h) / cut + 2 * mask + (act_bwd + 3 * a * s) / t
    tokens = b * s // cp
    return {"forward": forward * tokens * width, "backward": backward * tokens * width,
            "softmax": 2 * a * s / t * tokens * width}


def microbatch_seconds(shape: ModelShape, device: Device, t: int, b: int, layers: int, last: bool, width: int,
                       sequence_parallel: bool, recompute: str = "none", cp: int = 1, cp_kind: str = "ring") -> dict:
    """Forward and backward seconds of one microbatch on a rank holding `layers` blocks (and the head if
    `last`) and b·s/cp of its tokens, split into matmuls, attention and elementwise; and its hardware
    and model FLOPs."""
    g = shape.gpt
    gemms = block_gemms(shape, t, b, cp, cp_kind)
    matmul = sum(device.seconds(x, width) for x in gemms["matmuls"])
    attention = device.attention_seconds(*gemms["attention"], width)
    moved = elementwise_bytes(shape, t, b, sequence_parallel, width, device.flash_attention, cp)
    elementwise = moved["forward"] / device.hbm_bytes_per_s
    elementwise_back = moved["backward"] / device.hbm_bytes_per_s
    head = Gemm(b * g.seq_len // cp, g.padded_vocab_size // t, g.d_model)
    head_s = device.seconds(head, width) if last else 0.0
    forward = layers * (matmul + attention + elementwise) + head_s
    block_flops = sum(x.flops for x in gemms["matmuls"]) + sum(x.flops for x in gemms["attention"])
    model_flops = 3 * (layers * block_flops + (head.flops if last else 0.0))
    extra_s, extra_flops = 0.0, 0.0
    if recompute == "full":
        extra_s, extra_flops = layers * (matmul + attention + elementwise), layers * block_flops
    elif recompute == "selective":
        softmax = moved["softmax"] / device.hbm_bytes_per_s  # the attention core's own kernel, recomputed with it
        extra_s, extra_flops = layers * (attention + softmax), layers * sum(x.flops for x in gemms["attention"])
    backward = 2 * (layers * (matmul + attention) + head_s) + layers * elementwise_back + extra_s
    return {"forward": forward, "backward": backward, "recompute": extra_s,
            "matmuls": 3 * layers * matmul + (3 * head_s), "attention": 3 * layers * attention,
            "elementwise": layers * (elementwise + elementwise_back), "model_flops": model_flops,
            "hardware_flops": model_flops + extra_flops}
