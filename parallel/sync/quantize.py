"""The formats a collective may carry gradients (and ZeRO-3's weights) in, and their error bounds.

  fp32   the training dtype itself: nothing is lost
  bf16   each element rounded to bfloat16 (8 bits of significand): relative error at most 2^-8
  int8   per block of BLOCK elements one fp32 scale s = absmax / 127; an element x is sent as the
         integer round(x / s) in [-127, 127]: absolute error at most s / 2 (ZeRO++'s qwZ and qgZ)
  fp8    per block one fp32 scale s = absmax / 448 (float8_e4m3fn's largest value); x / s rounded to
         e4m3 (3 bits of fraction): error at most 2^-4 |x| in the normal range, and 2^-10 s below it
         (half the smallest subnormal, 2^-9, in units of s)

A block-scaled chunk travels as bytes: its codes (one byte per element, the uint8 view of the int8
or float8 values), then its scales (four bytes per block; the last block may be short). gloo sums
neither int8 nor float8, and a sum of codes under different scales would mean nothing anyway: the
collectives (parallel/sync/lowprec.py) move these bytes and do the arithmetic themselves, in fp32.
"""

from __future__ import annotations

import torch

COMM_DTYPES = ("fp32", "bf16", "fp8", "int8")
BLOCK_SCALED = ("fp8", "int8")
BLOCK = 256  # elements per scale
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
LARGEST_CODE = {"int8": 127.0, "fp8": 448.0}
SCALE_DTYPE = torch.float32


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def packed_numel(numel: int) -> int:
    """Bytes of one packed chunk of `numel` elements: its codes, then its scales."""
    return numel + blocks(numel) * torch.finfo(SCALE_DTYPE).bits // 8


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """x (1-D, fp32) as rows of BLOCK elements, the last row padded with zeros."""
    rows = blocks(x.numel())
    padded = torch.zeros(rows * BLOCK, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    return padded.view(rows, BLOCK)


def block_scales(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """One scale per block: its largest magnitude over the format's largest code, and never below
    fp32's smallest normal number: a block of tiny values (residuals of error feedback reach them)
    would otherwise get a scale that underflows to 0, and 0/0 codes. Such a block's values are
    below LARGEST_CODE·tiny, so they still fit; a block of zeros has zero codes whatever its scale."""
    scales = _blocked(x.float()).abs().amax(dim=1) / LARGEST_CODE[fmt]
    return scales.clamp_min(torch.finfo(torch.float32).tiny)


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (1-D) -> (codes as uint8, one byte per element; fp32 scales, one per block)."""
    scales = block_scales(x, fmt)
    scaled = (_blocked(x.float()) / scales[:, None]).reshape(-1)[: x.numel()]
    top = LARGEST_CODE[fmt]
    if fmt == "int8":
        codes = scaled.round().clamp_(-top, top).to(torch.int8)
    else:
        codes = scaled.clamp_(-top, top).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 values the codes stand for."""
    values = codes.view(CODE_DTYPES[fmt]).float()
    return (_blocked(values) * scales[:, None]).reshape(-1)[: codes.numel()]


def pack(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (1-D) as one uint8 chunk of packed_numel(x.numel()) bytes: codes, then scales."""
    codes, scales = quantize(x, fmt)
    return torch.cat([codes, scales.view(torch.uint8)])


def unpack(chunk: torch.Tensor, fmt: str, numel: int) -> torch.Tensor:
    """The fp32 values of a chunk `pack` made of `numel` elements."""
    scales = chunk[numel:].clone().view(SCALE_DTYPE)  # a copy: the bytes may lie at any offset
    return dequantize(chunk[:numel], scales, fmt)


def error_bound(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per element, the most that sending x (1-D) in `fmt` may change it (the module's table)."""
    x = x.float()
    if fmt == "fp32":
        return torch.zeros_like(x)
    if fmt == "bf16":
        return x.abs() * 2.0 ** -8
    per_element = block_scales(x, fmt).repeat_interleave(BLOCK)[: x.numel()]
    if fmt == "int8":
        return per_element / 2
    return x.abs() * 2.0 ** -4 + per_element * 2.0 ** -10


def chunked_error_bound(x: torch.Tensor, fmt: str, chunks: int) -> torch.Tensor:
    """error_bound of x sent as `chunks` equal chunks, each with blocks of its own (what the
    collectives do: a chunk per destination rank); x's length a multiple of `chunks`."""
    return torch.cat([error_bound(c, fmt) for c in x.float().chunk(chunks)])


def sum_error_bound(inputs: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """Per element, how far a reduction of `inputs` (one per rank, each cut in len(inputs) chunks)
    done in `fmt` may land from their exact sum. Block-scaled: each rank's chunk is quantized once
    and the sum taken in fp32, so the bounds add. bf16: each input is rounded, divided by N and
    every one of the N - 1 additions rounded again, each at most 2^-8 of the magnitudes summed."""
    n = len(inputs)
    if fmt == "bf16":
        return (n + 1) * sum(x.float().abs() for x in inputs) * 2.0 ** -8
    return sum(chunked_error_bound(x, fmt, n) for x in inputs)


def all_reduce_error_bound(inputs: list[torch.Tensor], exact_sum: torch.Tensor, fmt: str) -> torch.Tensor:
    """The bound of a block-scaled all-reduce: its reduce-scatter's, then the all-gather's of the
    reduced chunks, which lie within that first bound of the exact sum (bf16 all-reduces in one go)."""
    first = sum_error_bound(inputs, fmt)
    if fmt not in BLOCK_SCALED:
        return first
    return first + chunked_error_bound(exact_sum.abs() + first, fmt, len(inputs))
