"""The low-precision collectives: what the syncs call, in the format `parallel.comm_dtype` names.

`LowPrecisionCollectives` wraps the group's Communicator and offers the three collectives the
gradient syncs and ZeRO-3 use, with the Communicator's signatures, so that a sync is written once
and only the object it calls changes:

  fp32   no wrapper: `collectives` hands the syncs the Communicator itself, so a run is, call for
         call, the run it was before the option existed
  bf16   as PyTorch DDP's bf16_compress_hook: cast to bf16, divide by the group's size, the
         collective in bf16 (gloo and NCCL sum bf16), cast back; then multiply by the size again,
         since the project's gradients are sums (every microbatch loss is already divided by the
         global token count), where DDP's hook leaves a mean
  int8,  ZeRO++'s quantized reduce-scatter (qgZ): each destination's chunk quantized with its own
  fp8    block scales (parallel/sync/quantize.py), one all-to-all of the bytes, and every rank
         dequantizes the N chunks it received and sums them in fp32, in rank order. An all-reduce
         is that reduce-scatter, then a quantized all-gather of the reduced chunks (qwZ's way for
         weights), after which every rank, the chunk's owner too, holds the same dequantized values

Error feedback (`error_feedback=True`, the all-reduce of dp): a block-scaled format rounds every
element the same way step after step, so a small gradient component could be lost for good; each
rank keeps what quantizing its input lost (the residual) and adds it to the next call's input under
the same tag (Seide et al. 2014; Karimireddy et al. 2019), and each chunk's owner does the same for
its reduced chunk before the all-gather (1-bit Adam's server-side compensation). ZeRO's
reduce-scatter has none, as in ZeRO++: a residual as large as the gradient would bring back on
every rank the full gradient that stage 2 and 3 exist to shard.

An async call's handle waits for its collective and then does the local arithmetic; an int8 or
fp8 all-reduce posts its all-gather only then, since it needs the reduced chunks.
"""

from __future__ import annotations

import torch

from parallel.dist.comm import Communicator
from parallel.sync.quantize import BLOCK_SCALED, pack, packed_numel, unpack


class Deferred:
    """An async collective and the work that must follow it once it is done."""

    def __init__(self, handle, then):
        self._handle, self._then = handle, then

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            self._then()


def _finish(handle, then, async_op: bool):
    deferred = Deferred(handle, then)
    if async_op:
        return deferred
    deferred.wait()
    return None


class LowPrecisionCollectives:
    """The all-reduce, reduce-scatter and all-gather of a group, carried in `fmt` (bf16, int8, fp8)."""

    def __init__(self, comm: Communicator, fmt: str, error_feedback: bool = False, meter=None):
        self.comm, self.fmt, self.error_feedback = comm, fmt, error_feedback
        self.size, self.rank = comm.size, comm.rank
        self.residuals: dict[tuple[str, str], torch.Tensor] = {}  # (tag, "sent" | "owned") -> residual
        self.meter = meter  # ZeRO's MemoryMeter, which counts the wire copies while they live; or None

    def _hold(self, *tensors: torch.Tensor):
        """Count the wire copies `tensors` on the meter; returns what takes them off again."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.meter is None:
            return lambda: None
        self.meter.add(nbytes)
        return lambda: self.meter.sub(nbytes)

    def _packed(self, x: torch.Tensor, tag: str, kind: str, pieces: int) -> torch.Tensor:
        """x (1-D fp32) packed as `pieces` equal chunks, with error feedback if on."""
        if self.error_feedback:
            x = x + self.residuals.get((tag, kind), 0)
        chunks = x.chunk(pieces)
        packed = torch.cat([pack(c, self.fmt) for c in chunks])
        if self.error_feedback:
            numel, width = chunks[0].numel(), packed_numel(chunks[0].numel())
            sent = torch.cat([unpack(c, self.fmt, numel) for c in packed.split(width)])
            self.residuals[(tag, kind)] = x - sent
        return packed

    def _unpacked(self, packed: torch.Tensor, numel: int) -> list[torch.Tensor]:
        return [unpack(c, self.fmt, numel) for c in packed.split(packed_numel(numel))]

    def _sum_received(self, received: torch.Tensor, numel: int) -> torch.Tensor:
        total = torch.zeros(numel, dtype=torch.float32, device=received.device)
        for values in self._unpacked(received, numel):  # rank order: every run sums alike
            total += values
        return total

    def _scatter_packed(self, full: torch.Tensor, tag: str):
        """Post the quantized reduce-scatter of `full` (1-D, N equal chunks): (handle, received bytes,
        what releases the two wire buffers)."""
        send = self._packed(full.float(), tag, "sent", self.size)
        received = torch.empty_like(send)
        release = self._hold(send, received)
        return self.comm.all_to_all_single(received, send, tag=tag, async_op=True), received, release

    def _gather_packed(self, shard: torch.Tensor, tag: str, kind: str | None = None) -> list[torch.Tensor]:
        """The quantized all-gather of `shard` (blocking): every rank's chunk, dequantized."""
        packed = self._packed(shard.float(), tag, kind, 1) if kind else pack(shard.float(), self.fmt)
        gathered = torch.empty(packed.numel() * self.size, dtype=torch.uint8, device=shard.device)
        release = self._hold(packed, gathered)
        self.comm.all_gather_into(gathered, packed, tag=tag)
        values = self._unpacked(gathered, shard.numel())
        release()
        return values

    # -- the collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, tag: str, async_op: bool = False):
        """Sum `tensor` in place over the group."""
        if self.fmt == "bf16":
            wire = tensor.to(torch.bfloat16).div_(self.size)
            handle = self.comm.all_reduce(wire, tag=tag, async_op=True)
            return _finish(handle, lambda: tensor.copy_(wire).mul_(self.size), async_op)
        numel = tensor.numel()
        chunk = -(-numel // self.size)
        full = torch.zeros(chunk * self.size, dtype=torch.float32, device=tensor.device)
        full[:numel] = tensor.reshape(-1)
        handle, received, release = self._scatter_packed(full, tag)

        def then():
            reduced = self._sum_received(received, chunk)
            release()
            gathered = torch.cat(self._gather_packed(reduced, tag, "owned" if self.error_feedback else None))
            tensor.copy_(gathered[:numel].view_as(tensor))

        return _finish(handle, then, async_op)

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor, tag: str, async_op: bool = False):
        """Sum `full_in` over the group and keep this rank's chunk in `shard_out`."""
        if self.fmt == "bf16":
            wire_in = full_in.to(torch.bfloat16).div_(self.size)
            wire_out = torch.empty(shard_out.shape, dtype=torch.bfloat16, device=shard_out.device)
            release = self._hold(wire_in, wire_out)
            handle = self.comm.reduce_scatter(wire_out, wire_in, tag=tag, async_op=True)
            return _finish(handle, lambda: (shard_out.copy_(wire_out).mul_(self.size), release()), async_op)
        handle, received, release = self._scatter_packed(full_in.reshape(-1), tag)
        return _finish(handle, lambda: (shard_out.copy_(self._sum_received(received, shard_out.numel())), release()),
                       async_op)

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, tag: str):
        """Every rank's `shard` concatenated into `output` (blocking: ZeRO-3 needs it at once)."""
        if self.fmt == "bf16":
            wire, mine = torch.empty(output.shape, dtype=torch.bfloat16, device=output.device), shard.to(torch.bfloat16)
            release = self._hold(wire, mine)
            self.comm.all_gather_into(wire, mine, tag=tag)
            output.copy_(wire)
            release()
            return None
        output.copy_(torch.cat(self._gather_packed(shard, tag)))
        return None

    def wait_all(self) -> None:
        self.comm.wait_all()


def collectives(comm: Communicator | None, fmt: str, error_feedback: bool = False, meter=None):
    """The Communicator itself for fp32 (or no group), else its low-precision collectives."""
    if comm is None or fmt == "fp32":
        return comm
    return LowPrecisionCollectives(comm, fmt, error_feedback and fmt in BLOCK_SCALED, meter)
