"""The codec's time: the elementwise work of the lossy collectives and of DiLoCo's outer step.

A low-precision collective (parallel/sync/lowprec.py, parallel/sync/quantize.py) does more than send
fewer bytes: before the wire it casts, or computes a scale per block and quantizes, and after it
dequantizes and sums, each an elementwise pass over every gradient element on the rank's own
cores (or its GPU's memory). Its seconds are

    elements x bytes per element / rate      bytes per element = sum over the passes of what each
                                             reads and writes (a pass over a share of the elements,
                                             a chunk of 1/N, counts that share)

The passes below are the code's own torch operations, one entry per operation that touches every
element, in the order lowprec.py runs them; per-block work (the scales themselves: 1/256 of the
elements) is left out. Error feedback (dp's all-reduce in int8 and fp8) adds the residual before
quantizing and keeps what was lost after (`_packed`). The rate: on a GPU preset its HBM bandwidth
(each pass a memory-bound kernel); on this machine a probe, `pack` and `unpack` timed on 4 MiB
(`probed_bytes_per_s`) by every rank of the planned world at once (parallel/planner/loopback.py), so
that the cores' share is measured, not assumed, with the host allocator a run's ranks have (a process
under glibc's defaults may time page faults, several times the passes).

DiLoCo's outer step is the same kind of work (parallel/diloco/strategy.py): once per H steps, the
pseudo-gradient over every parameter and the Nesterov update, timed here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Pass:
    """One elementwise operation: the bytes it reads and writes per element, over `share` of them."""

    name: str
    read: int
    written: int
    share: Fraction = Fraction(1)

    def over(self, share) -> Pass:
        return Pass(self.name, self.read, self.written, self.share * share)


def bytes_per_element(passes: list[Pass]) -> Fraction:
    return sum((p.share * (p.read + p.written) for p in passes), Fraction(0))


def pass_count(passes: list[Pass]) -> Fraction:
    """Passes per element (a pass over a chunk of 1/N counts 1/N)."""
    return sum((p.share for p in passes), Fraction(0))


def _over(passes: list[Pass], share) -> list[Pass]:
    return [p.over(share) for p in passes]


# quantize.py, per element of a chunk: `_blocked` fills a zeroed buffer of whole blocks, twice per quantize.
BLOCKED = [Pass("zeroed block buffer", 0, 4), Pass("copy into the blocks", 4, 4)]
QUANTIZE = {
    "int8": [*BLOCKED, Pass("abs", 4, 4), Pass("amax per block", 4, 0), *BLOCKED, Pass("divide by the scale", 4, 4),
             Pass("round", 4, 4), Pass("clamp", 4, 4), Pass("cast to int8", 4, 1)],
    "fp8": [*BLOCKED, Pass("abs", 4, 4), Pass("amax per block", 4, 0), *BLOCKED, Pass("divide by the scale", 4, 4),
            Pass("clamp", 4, 4), Pass("cast to float8_e4m3fn", 4, 1)],
}
CONCATENATE_CODES = Pass("concatenate codes and scales", 1, 1)
DEQUANTIZE = [Pass("codes to fp32", 1, 4), *BLOCKED, Pass("multiply by the scale", 4, 4)]
BF16_DOWN = [Pass("cast to bf16", 4, 2), Pass("divide by N", 2, 2)]
BF16_UP = [Pass("copy back to fp32", 2, 4), Pass("multiply by N", 4, 4)]


def pack_passes(fmt: str) -> list[Pass]:
    """quantize.pack: quantize, then the codes and scales in one chunk."""
    return [*QUANTIZE[fmt], CONCATENATE_CODES]


def packed_passes(fmt: str, error_feedback: bool) -> list[Pass]:
    """lowprec's `_packed`: every chunk packed and the chunks concatenated; with error feedback the
    residual added first, and after, the packed values dequantized and the new residual kept."""
    passes = [*pack_passes(fmt), Pass("concatenate the chunks", 1, 1)]
    if not error_feedback:
        return passes
    return [Pass("add the residual", 8, 4), *passes, *DEQUANTIZE, Pass("concatenate the sent values", 4, 4),
            Pass("residual = input - sent", 8, 4)]


def sum_received_passes(fmt: str, n: int) -> list[Pass]:
    """`_sum_received`: a zeroed chunk, then each of the N received chunks dequantized and added
    (per element of the whole input: one of each)."""
    return [Pass("zeroed sum", 0, 4, Fraction(1, n)), *DEQUANTIZE, Pass("add into the sum", 8, 4)]


def gather_passes(fmt: str, n: int, error_feedback: bool = False) -> list[Pass]:
    """An all-gather of a 1/N shard into every element: the shard cast or packed (with error feedback:
    the owner's residual, `_packed`), then every element dequantized (block-scaled) and copied out."""
    if fmt == "bf16":
        return [Pass("cast to bf16", 4, 2, Fraction(1, n)), Pass("copy back to fp32", 2, 4)]
    send = packed_passes(fmt, True) if error_feedback else pack_passes(fmt)
    return [*_over(send, Fraction(1, n)), *DEQUANTIZE, Pass("concatenate the chunks", 4, 4), Pass("copy out", 4, 4)]


def all_reduce_passes(fmt: str, n: int, error_feedback: bool) -> list[Pass]:
    """`LowPrecisionCollectives.all_reduce` per element of the tensor, over N ranks."""
    if fmt == "fp32":
        return []
    if fmt == "bf16":
        return [*BF16_DOWN, *BF16_UP]
    pad = [Pass("zeroed padded copy", 0, 4), Pass("copy in", 4, 4)]
    return [*pad, *packed_passes(fmt, error_feedback), *sum_received_passes(fmt, n),
            *gather_passes(fmt, n, error_feedback)]


def reduce_scatter_passes(fmt: str, n: int) -> list[Pass]:
    """`LowPrecisionCollectives.reduce_scatter` per element of the full input (ZeRO's: no error feedback)."""
    if fmt == "fp32":
        return []
    if fmt == "bf16":
        return [*BF16_DOWN, *_over(BF16_UP, Fraction(1, n))]
    return [*packed_passes(fmt, False), *sum_received_passes(fmt, n), Pass("copy the shard out", 4, 4, Fraction(1, n))]


def all_gather_passes(fmt: str, n: int) -> list[Pass]:
    """`LowPrecisionCollectives.all_gather_into` per element of the gathered output."""
    return [] if fmt == "fp32" else gather_passes(fmt, n)


# PyTorch DDP's bf16_compress_hook (torch_ddp with comm_dtype=bf16): cast and divide, then one copy back.
DDP_BF16_HOOK = [*BF16_DOWN, Pass("copy back to fp32", 2, 4)]


def outer_step_passes(momentum: bool) -> list[Pass]:
    """DiLoCo's `outer_step` per parameter: the pseudo-gradient into one flat buffer, divided by N; after
    the all-reduce, the Nesterov update of the momentum and the outer copy, copied into the model."""
    passes = [Pass("outer - local", 8, 4), Pass("concatenate", 4, 4), Pass("divide by N", 4, 4)]
    if momentum:
        passes += [Pass("momentum x mu", 4, 4), Pass("momentum + delta", 8, 4), Pass("delta + mu x momentum", 8, 4)]
    return [*passes, Pass("outer - lr x delta", 8, 4), Pass("copy into the model", 4, 4)]


# -- the rate ----------------------------------------------------------------------------------------
PROBE_ELEMENTS = 2**20  # 4 MiB of fp32 gradients: about one model part's bucket at the sandbox's sizes
PROBE_FORMAT = "int8"
PROBE_CALLS = 40  # pack and unpack calls timed as one span, long beside a scheduler's time slice


def probe_passes() -> list[Pass]:
    """What the probe times: one chunk packed and unpacked (quantize.py's `pack`, `unpack`)."""
    return [*pack_passes(PROBE_FORMAT), *DEQUANTIZE]


def probed_bytes_per_s(threads: int) -> float:
    """This process's codec rate with `threads` torch threads: the probe's bytes over the time of
    PROBE_CALLS pack-and-unpack calls on PROBE_ELEMENTS, timed as one span, so that where ranks share the
    cores (parallel/planner/loopback.py runs this on every rank at once) the share is in the time.

    The process's host allocator is set first as a run's ranks set theirs (`train.host_allocator`'s
    default, `keep`: parallel/core/host_memory.py). The codec's temporaries are megabytes; under glibc's
    defaults a process maps each one anew or not depending on its history, and where it does every pass
    pays its page faults, several times the passes' own time."""
    import time

    import torch

    from parallel.core.host_memory import apply_host_allocator
    from parallel.sync.quantize import pack, unpack

    apply_host_allocator("keep")
    x = torch.randn(PROBE_ELEMENTS)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):  # the first calls' allocations
            unpack(pack(x, PROBE_FORMAT), PROBE_FORMAT, PROBE_ELEMENTS)
        start = time.perf_counter()
        for _ in range(PROBE_CALLS):
            unpack(pack(x, PROBE_FORMAT), PROBE_FORMAT, PROBE_ELEMENTS)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    return PROBE_CALLS * PROBE_ELEMENTS * float(bytes_per_element(probe_passes())) / seconds


# -- per step ------------------------------------------------------------------------------------------
def codec_passes(spec, layout, zero: int) -> list[tuple[list[Pass], Fraction]]:
    """(passes, calls per step) of one rank's codec work: its gradient reductions and ZeRO-3's gathers
    in parallel.comm_dtype, DiLoCo's outer step (once per H steps); each per element of the model's
    parameters, which every rank of these strategies (dp, ZeRO, DiLoCo: no tp, no pipeline) holds."""
    from parallel.algebra import replica_group_size
    from parallel.diloco.options import DiLoCoOptions
    from parallel.sync.options import SyncOptions
    from parallel.sync.quantize import BLOCK_SCALED

    work = []
    if spec.uses(DiLoCoOptions):
        outer = layout.of(DiLoCoOptions)
        work.append((outer_step_passes(outer.outer_momentum > 0), Fraction(1, outer.inner_steps)))
    fmt, n, m = layout.of(SyncOptions).comm_dtype, replica_group_size(layout.dims), layout.microbatches
    if fmt == "fp32" or n <= 1 or not spec.honours_option(SyncOptions, "comm_dtype"):
        return work
    if zero == 0:  # one all-reduce per step (the last microbatch's backward), with error feedback if block-scaled
        hook = DDP_BF16_HOOK if "baseline" in spec.tags else all_reduce_passes(fmt, n, fmt in BLOCK_SCALED)
        return [*work, (hook, Fraction(1))]
    work.append((reduce_scatter_passes(fmt, n), Fraction(1 if zero == 1 else m)))  # ZeRO-2/3: every microbatch
    if zero == 3:
        work.append((all_gather_passes(fmt, n), Fraction(2 * m)))  # before each part's forward and backward
    return work


def work_bytes_per_element(work: list[tuple[list[Pass], Fraction]]) -> Fraction:
    """Bytes read and written per element over `work`, (passes, calls per step) pairs: the one sum the
    codec, the optimizer step (optimizer_step.py) and the sharded strategies' copies (shard_copies.py) share."""
    return sum((calls * bytes_per_element(passes) for passes, calls in work), Fraction(0))


def elementwise_seconds(work: list[tuple[list[Pass], Fraction]], elements: int, rate: float | None) -> float:
    """Seconds of memory-bound `work` over `elements`: its bytes at `rate` (0 where the cluster has none)."""
    return float(work_bytes_per_element(work)) * elements / rate if rate else 0.0


def codec_bytes(shape, spec, layout, zero: int) -> float:
    """Bytes one rank's codec reads and writes per step."""
    return float(work_bytes_per_element(codec_passes(spec, layout, zero))) * shape.parameter_count()


def codec_seconds(shape, spec, layout, zero: int, cluster) -> float:
    """One rank's codec seconds per step: its bytes at the cluster's codec rate."""
    return elementwise_seconds(codec_passes(spec, layout, zero), shape.parameter_count(), cluster.codec_bytes_per_s)
