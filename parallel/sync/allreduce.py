"""The all-reduce syncs, written by hand on the communication log.

Every rank of a group holds the same parameters and ran its own slice of the global batch; before
the optimizer, gradients are summed over the group so every rank takes the same step.

Two ways to do the sum:

* `NaiveGradSync` waits until backward is over, then all-reduces each gradient in turn. Simple,
  and nothing overlaps: the whole all-reduce time is added to the step.
* `BucketedGradSync` does what PyTorch DDP does. Gradients live in a few flat buffers (buckets),
  filled in the order backward produces them (roughly the reverse of the forward order). A
  post-accumulate-grad hook on every parameter counts down its bucket; when a bucket is complete
  its all-reduce starts asynchronously while backward carries on with earlier layers. Buckets are
  launched strictly in index order so every rank issues the same collectives in the same order.

With `parallel.comm_dtype` other than fp32 the all-reduces go through parallel/sync/lowprec.py
in that format; with a block-scaled one (int8, fp8) a bucket is one model part.

With gradient accumulation only the last microbatch's backward triggers communication: the
gradients of earlier microbatches accumulate locally, and the sum is synced once per step.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from parallel.core.model import part_of
from parallel.dist.comm import Communicator, Handle
from parallel.strategy import GradSync
from parallel.sync.lowprec import collectives
from parallel.sync.quantize import BLOCK_SCALED

log = logging.getLogger(__name__)

MiB = 1 << 20
# PyTorch DDP makes its first bucket small (1 MiB) so the first all-reduce starts early in
# backward; we do the same so the two are compared like for like. (DDP does so only when its
# bucket_cap_mb is left at its default: parallel/baselines/ddp.py leaves it there for the default
# parallel.bucket_mb of 25. Its first bucket is first in *ready* order: DDP rebuilds its buckets
# after the first step in the order gradients arrived, reversed parameters as here.)
FIRST_BUCKET_BYTES = 1 * MiB


class NaiveGradSync(GradSync):
    """After backward, all-reduce every gradient in turn; nothing overlaps with computation.

    `named_params`: the parameters under their single-process names (a whole model, a tp shard or
    a pipeline stage alike); the name gives each all-reduce its tag, `grads/<part>`.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Communicator):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        super().__init__([p for _, p in named])
        self.named_params = named
        self.comm = comm

    def finish(self) -> None:
        for name, p in self.named_params:
            self.comm.all_reduce(p.grad, tag=f"grads/{part_of(name)}")
        self.complete()  # sums commute: completing over another group after ours is the same


class Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
        self.waiting = len(params)
        self.handle: Handle | None = None
        # Gradients as views into the bucket (DDP's gradient_as_bucket_view): autograd
        # accumulates straight into the buffer, so no copy in or out is needed.
        offset = 0
        for p in params:
            p.grad = self.buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class BucketedGradSync(GradSync):
    """PyTorch DDP's way: gradients in flat buckets, each all-reduced as soon as backward fills it."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, bucket_bytes: int,
                 groups: list[list[nn.Parameter]] | None = None):
        """`groups`: the buckets' parameters, in backward order, where not cut by `bucket_bytes`."""
        params = [p for p in params if p.requires_grad]
        super().__init__(params)
        self.comm = comm
        self.buckets = self._make_buckets(list(reversed(params)), bucket_bytes) if groups is None else \
            [Bucket(i, g, g[0].device, g[0].dtype) for i, g in enumerate(groups)]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._armed = False
        self._next_to_launch = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        log.info("dp buckets (bytes): %s", [b.nbytes for b in self.buckets])

    @staticmethod
    def _make_buckets(params_in_backward_order: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
        groups, current, size = [], [], 0
        cap = min(FIRST_BUCKET_BYTES, bucket_bytes)
        for p in params_in_backward_order:
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                groups.append(current)
                current, size, cap = [], 0, bucket_bytes
        if current:
            groups.append(current)
        p0 = params_in_backward_order[0]
        return [Bucket(i, g, p0.device, p0.dtype) for i, g in enumerate(groups)]

    def zero_grad(self) -> None:
        # Zero in place: the gradients are views into the buckets and must stay so.
        for b in self.buckets:
            b.buffer.zero_()
            b.waiting = len(b.params)
            b.handle = None
        self._next_to_launch = 0

    def before_microbatch(self, last: bool) -> None:
        """Only the last microbatch's gradients communicate; earlier ones just accumulate. A rank may
        run the last microbatch's backward in several calls (one per chunk it holds, or a split
        backward's B and W): each counts its parameters down, and a bucket goes when all of its have."""
        self._armed = last

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        self._bucket_of[param].waiting -= 1
        # Launch every complete bucket in index order, never out of order, so that all ranks
        # post the same sequence of collectives.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].waiting == 0:
            b = self.buckets[self._next_to_launch]
            b.handle = self.comm.all_reduce(b.buffer, tag=f"grads/bucket{b.index}", async_op=True)
            self._next_to_launch += 1

    def finish(self) -> None:
        if self._next_to_launch != len(self.buckets):
            stuck = [b.index for b in self.buckets if b.handle is None]
            raise RuntimeError(
                f"buckets {stuck} never became ready: some parameters got no gradient in backward "
                "(every parameter must take part in the loss for bucketed data parallelism)"
            )
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
        self._armed = False
        # Only now that no bucket is on the wire may another group's sum touch these gradients.
        self.complete()


GRAD_SYNCS = ("bucketed", "naive")


def part_buckets(named_params: list[tuple[str, nn.Parameter]]) -> list[list[nn.Parameter]]:
    """One bucket per model part, in backward order: the block-scaled formats' buckets, so that the
    bytes of their padding and scales have a closed form on the parts, as ZeRO's do."""
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in reversed(named_params):
        if p.requires_grad:
            groups.setdefault(part_of(name), []).append(p)
    return list(groups.values())


def make_grad_sync(named_params: list[tuple[str, nn.Parameter]], comm: Communicator | None, grad_sync: str,
                   bucket_mb: float, comm_dtype: str = "fp32") -> GradSync:
    """The gradient sync `parallel.grad_sync` names over `comm` (the dp group), its all-reduces in
    `comm_dtype` (parallel/sync/lowprec.py); with no dp group to sum over (None, or one rank), the
    no-op GradSync."""
    if comm is None or comm.size == 1:
        return GradSync([p for _, p in named_params if p.requires_grad])
    wire = collectives(comm, comm_dtype, error_feedback=True)
    if grad_sync == "naive":
        return NaiveGradSync(named_params, wire)
    if grad_sync == "bucketed":
        groups = part_buckets(named_params) if comm_dtype in BLOCK_SCALED else None
        return BucketedGradSync([p for _, p in named_params], wire, int(bucket_mb * MiB), groups)
    raise ValueError(f"parallel.grad_sync={grad_sync!r}: choose one of {', '.join(GRAD_SYNCS)}")
