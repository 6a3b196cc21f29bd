"""The only place that calls torch.distributed collectives and point-to-point ops.

A `Communicator` is one process group under a stable name; every call it makes is recorded in the
run's `CommLog` (commlog.py) with its bytes, from shapes and dtypes, so counting never synchronises
a device (traffic.py: the ring formulas and the sums), and, inside a step with a clock, as a span.
A call that fails names its op, tag, group and peer (`CommFailure`). Every call also leaves a
record in the rank's flight recorder (flight.py: the last calls, numbered per group, and the one the
rank is blocked in), which a hang dumps to the run directory.

The log and the traffic's records and summaries are importable from here too, so that a caller
needs one module for everything about communication.
"""

from __future__ import annotations

import math
import pickle
import time

import torch
import torch.distributed as dist

from parallel.dist.commlog import CommLog, DeviceInterval
from parallel.dist.failures import failure_kind, failure_line, watchdog_verdict
from parallel.dist.flight import channel
from parallel.dist.timing import cpu_stamp
from parallel.dist.traffic import (
    TOOLING_PREFIX,
    StepTraffic,
    Totals,
    calls_by_tag_op,
    is_tooling,
    ring_bytes_sent,
    summarize_traffic,
    tensor_bytes,
    traffic_by_tag_op,
)

__all__ = [
    "TOOLING_PREFIX", "CommFailure", "CommLog", "Communicator", "DeviceInterval", "Handle", "StepTraffic", "Totals",
    "calls_by_tag_op", "is_tooling", "ring_bytes_sent", "summarize_traffic", "tensor_bytes", "traffic_by_tag_op",
]


class CommFailure(RuntimeError):
    """A call that failed or timed out (a peer died or hangs), named by op, tag, group and peer."""


def _failed(comm: Communicator, op: str, tag: str, error: Exception, peer: int | None = None) -> CommFailure:
    """The failed call named, with gloo's or NCCL's words in one line (failures.py). A call on a
    group whose communicators NCCL's watchdog aborted may say only that ("NCCL communicator was
    aborted on rank N."): the group's recorded error says why."""
    first_line = failure_line(error)
    recorded = comm.watchdog_error() if failure_kind(first_line) is None else None
    if recorded:
        first_line = f"{watchdog_verdict(recorded)} ({first_line})"
    with_peer = f" with rank {comm.global_ranks[peer]}" if peer is not None else ""
    return CommFailure(f"{op} {tag!r} over group {comm.name} (ranks {comm.global_ranks}){with_peer}: {first_line}")


class Handle:
    """An async call's work object; `wait()` charges the time blocked to the call's record."""

    def __init__(self, work, comm: Communicator, op: str, tag: str, cuda: bool = False, peer: int | None = None,
                 span_id: int | None = None, flights: tuple = ()):
        self._work = work
        self._flights = flights  # its flight records (several where NCCL coalesced a batch into one work)
        self._comm = comm
        self._op = op
        self._tag = tag
        self._cuda = cuda
        self._peer = peer
        self._span_id = span_id  # the post's span in this step (None: not spanning), which the wait names

    def wait(self) -> None:
        if self._work is None:
            return
        log = self._comm.log
        interval = DeviceInterval() if log.timed and self._cuda else None
        start = time.perf_counter() if log.timed and not self._cuda else 0.0
        cpu_start = cpu_stamp() if log.spanning else None
        waits = () if self._span_id is None else (self._span_id,)
        flight = self._comm.log.flight
        if self._flights:
            flight.block(self._flights[0])
        try:
            self._work.wait()
        except RuntimeError as e:
            for record in self._flights:
                flight.fail(record)
            raise _failed(self._comm, self._op, self._tag, e, self._peer) from e
        for record in self._flights:
            flight.complete(record)
        if interval is not None:
            log.add_device_interval(self._op, self._comm.name, self._tag, interval.stop())
            log.span("wait", self._op, self._comm.name, self._tag, *interval.stamps(), cpu_start=cpu_start, waits=waits)
        elif log.timed:
            end = time.perf_counter()
            log.add_seconds(self._op, self._comm.name, self._tag, end - start)
            log.span("wait", self._op, self._comm.name, self._tag, start, end, cpu_start=cpu_start, waits=waits)
        # Drop the work object at once: gloo work objects that outlive the process group keep
        # tensors alive into interpreter shutdown (see parallel/dist/groups.py).
        self._work = None
        self._comm._pending.discard(self)


class Communicator:
    """One process group under a stable name, with every call recorded.

    Strategies receive the communicators they use; nothing here is global.
    """

    def __init__(self, name: str, group, log: CommLog):
        self.name = name
        self.group = group
        self.log = log
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_ranks = dist.get_process_group_ranks(group)  # for error messages
        self._pending: set[Handle] = set()
        self._channels: dict[tuple, str] = {}  # the flight recorder's channel keys, formatted once

    def _flight(self, op: str, tag: str, payload_bytes: int, peer: int | None = None):
        """Post the call's flight record; a send's or receive's names its direction in global ranks."""
        me = self.global_ranks[self.rank]
        src, dst = (None, None) if peer is None else (
            (me, self.global_ranks[peer]) if op == "send" else (self.global_ranks[peer], me))
        key = self._channels.get((src, dst))
        if key is None:
            key = self._channels[(src, dst)] = channel(self.name, self.global_ranks, src, dst)
        return self.log.flight.post(op, self.name, self.global_ranks, tag, payload_bytes, src, dst, key)

    # -- bookkeeping --------------------------------------------------------------------------
    def _run(self, op: str, tag: str, payload_bytes: int, fn, async_op: bool, cuda: bool = False,
             peer: int | None = None, sent_bytes: int | None = None):
        """Call `fn`, record it; `cuda`: its tensors are on a GPU, so time it with CUDA events;
        `peer`: the other end of a send or receive, named if the call fails; `sent_bytes`: see
        `CommLog.record`."""
        timed = self.log.timed and not async_op
        spanning = self.log.spanning  # an async post is not timed, but drawn in the step's trace
        clocked = timed or spanning
        interval = DeviceInterval() if clocked and cuda else None
        start = time.perf_counter() if clocked and not cuda else 0.0
        cpu_start = cpu_stamp() if spanning else None
        flight = self._flight(op, tag, payload_bytes, peer)
        if not async_op:
            self.log.flight.block(flight)
        try:
            work = fn()
        except RuntimeError as e:
            self.log.flight.fail(flight)
            raise _failed(self, op, tag, e, peer) from e
        if not async_op:
            self.log.flight.complete(flight)
        end = time.perf_counter() if clocked and not cuda else 0.0
        entry = self.log.record(op, self.name, tag, payload_bytes, self.size, end - start if timed else 0.0, sent_bytes)
        if interval is not None:
            interval.stop()
            if timed:
                self.log.add_device_interval(op, self.name, tag, interval)
        span_id = None
        if spanning:
            stamps = interval.stamps() if interval is not None else (start, end)
            span_id = self.log.span("post" if async_op else "call", op, self.name, tag, *stamps, entry,
                                    cpu_start=cpu_start, peer=None if peer is None else self.global_ranks[peer])
        if async_op:
            handle = Handle(work, self, op, tag, cuda, peer, span_id, (flight,))
            self._pending.add(handle)
            return handle
        return None

    def wait_all(self) -> None:
        for handle in list(self._pending):
            handle.wait()

    def watchdog_error(self) -> str | None:
        """The error NCCL's watchdog recorded on this group once it failed one of its collectives and
        aborted its communicators (dist/groups.py nccl_failure_env): "TIMEOUT", "COMM_ERROR" or
        "REMOTE_ERROR"; None before that, and on gloo, whose calls raise in the caller's thread."""
        try:
            if dist.get_backend(self.group) != "nccl":
                return None
            error = getattr(self.group._get_backend(torch.device("cuda")), "get_error", lambda: None)()
        except (RuntimeError, ValueError):
            return None  # asked while reporting another failure: that one is the story
        return None if error is None or error.name == "SUCCESS" else error.name

    def backend_failure(self, op: str, tag: str) -> CommFailure | None:
        """The watchdog's error on this group as the failure of call `op` `tag`, or None."""
        error = self.watchdog_error()
        if error is None:
            return None
        return CommFailure(f"{op} {tag!r} over group {self.name} (ranks {self.global_ranks}): "
                           f"{watchdog_verdict(error)}")

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def backend(self) -> str:
        """The group's backend as torch has it ("gloo", "nccl"): an NCCL group takes CUDA tensors only."""
        return dist.get_backend(self.group)

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, tag: str, async_op: bool = False, op: str = "sum"):
        """Sum (or, with op="max", take the maximum of) `tensor` in place over the group.

        gloo has no AVG: callers pre-scale. MAX is what the vocab-parallel cross-entropy needs for
        its numerically stable softmax; it moves the same bytes as a sum.
        """
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._run(
            "all_reduce", tag, tensor_bytes(tensor),
            lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op),
            async_op, tensor.is_cuda,
        )

    def all_reduce_future(self, tensor: torch.Tensor, tag: str) -> torch.futures.Future:
        """An async sum whose result is a Future of the tensor (what DDP communication hooks return)."""
        start, cpu_start = time.perf_counter(), cpu_stamp()
        flight = self._flight("all_reduce", tag, tensor_bytes(tensor))
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        entry = self.log.record("all_reduce", self.name, tag, tensor_bytes(tensor), self.size)
        # Host time even on a GPU: DDP calls this hook from its reducer, and waits for it there, out
        # of the log's sight (the post has no wait span: the replay's rule for it is in parallel/replay/graph.py).
        self.log.span("post", "all_reduce", self.name, tag, start, time.perf_counter(), entry, cpu_start=cpu_start)
        return work.get_future().then(lambda fut: (self.log.flight.complete(flight), fut.value()[0])[1])

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, tag: str, async_op: bool = False):
        """Concatenate every rank's `shard` along dim 0 into `output` (payload: the full output)."""
        return self._run(
            "all_gather", tag, tensor_bytes(output),
            lambda: dist.all_gather_single(output, shard, group=self.group, async_op=async_op),
            async_op, output.is_cuda,
        )

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor, tag: str, async_op: bool = False):
        """Sum `full_in` over the group and keep this rank's dim-0 slice (payload: the full input)."""
        return self._run(
            "reduce_scatter", tag, tensor_bytes(full_in),
            lambda: dist.reduce_scatter_single(shard_out, full_in, op=dist.ReduceOp.SUM, group=self.group,
                                               async_op=async_op),
            async_op, full_in.is_cuda,
        )

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int, tag: str, async_op: bool = False):
        return self._run(
            "broadcast", tag, tensor_bytes(tensor),
            lambda: dist.broadcast(tensor, group_src=src_group_rank, group=self.group, async_op=async_op),
            async_op, tensor.is_cuda,
        )

    # -- point to point -----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst_group_rank: int, tag: str, async_op: bool = False):
        fn = dist.isend if async_op else dist.send
        return self._run("send", tag, tensor_bytes(tensor),
                         lambda: fn(tensor, group_dst=dst_group_rank, group=self.group), async_op, tensor.is_cuda,
                         peer=dst_group_rank)

    def recv(self, tensor: torch.Tensor, src_group_rank: int, tag: str, async_op: bool = False):
        fn = dist.irecv if async_op else dist.recv
        return self._run("recv", tag, tensor_bytes(tensor),
                         lambda: fn(tensor, group_src=src_group_rank, group=self.group), async_op, tensor.is_cuda,
                         peer=src_group_rank)

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int, str]]) -> list[Handle]:
        """Post several sends and receives at once: [("send"|"recv", tensor, peer group rank, tag)].

        Posting a rank's neighbouring send and receive together (torch's batch_isend_irecv, a
        single NCCL group call) is what keeps two pipeline ranks that send to each other at the
        same moment from deadlocking (Megatron's send_forward_recv_backward).
        """
        p2p = [
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=self.group, group_peer=peer)
            for kind, tensor, peer, _ in ops
        ]
        clock = self.log.clock if self.log.spanning else None
        start = clock.now() if clock is not None else None
        cpu_start = cpu_stamp() if clock is not None else None
        flights = [self._flight(kind, tag, tensor_bytes(tensor), peer) for kind, tensor, peer, tag in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as e:
            for record in flights:
                self.log.flight.fail(record)
            raise _failed(self, "batch_p2p", ops[0][3], e, ops[0][2]) from e
        end = clock.now() if clock is not None else None
        span_ids = []
        for kind, tensor, peer, tag in ops:
            entry = self.log.record(kind, self.name, tag, tensor_bytes(tensor), self.size)
            span_ids.append(self.log.span("post", kind, self.name, tag, start, end, entry, cpu_start=cpu_start,
                                          peer=self.global_ranks[peer]))
        # One work per op on gloo; NCCL may coalesce the batch into one. Waiting time is charged
        # to the op a work belongs to (the first op's, when coalesced).
        one_each = len(works) == len(ops)
        first = (ops[0][0], ops[0][3], None)
        labels = [(kind, tag, peer) for kind, _, peer, tag in ops] if one_each else [first] * len(works)
        cuda = any(tensor.is_cuda for _, tensor, _, _ in ops)
        ids = span_ids if one_each else [span_ids[0]] * len(works)
        records = [(f,) for f in flights] if one_each else [tuple(flights)] + [()] * (len(works) - 1)
        handles = [Handle(work, self, kind, tag, cuda, peer, span_id, flight)
                   for work, (kind, tag, peer), span_id, flight in zip(works, labels, ids, records)]
        self._pending.update(handles)
        return handles

    # -- python objects (tooling: run metadata, metrics) ----------------------------------------
    def broadcast_object(self, obj, src_group_rank: int, tag: str):
        box = [obj]
        payload = len(pickle.dumps(obj)) if self.rank == src_group_rank else 0
        self._run(
            "broadcast_object", tag, payload,
            lambda: dist.broadcast_object_list(box, group_src=src_group_rank, group=self.group),
            False,
        )
        return box[0]

    def gather_object(self, obj, dst_group_rank: int, tag: str):
        """Every rank's `obj` in a list on `dst_group_rank`, None elsewhere."""
        out = [None] * self.size if self.rank == dst_group_rank else None
        # What this rank sends: its pickled object, once, to the root; the root sends none (tooling
        # traffic, reported apart). torch pads each object to the largest and exchanges their sizes
        # first: neither is counted.
        payload = 0 if self.rank == dst_group_rank else len(pickle.dumps(obj))
        self._run(
            "gather_object", tag, payload,
            lambda: dist.gather_object(obj, out, group_dst=dst_group_rank, group=self.group),
            False,
        )
        return out

    def barrier(self, tag: str) -> None:
        self._run("barrier", tag, 0, lambda: dist.barrier(group=self.group), False)

    # -- all-to-all ---------------------------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, tag: str,
                          output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                          async_op: bool = False):
        """Rank r sends block j of `input` (dim 0) to rank j, which stores it as block r of `output`.

        Splits default to equal blocks of dim 0. Recorded as op "all_to_all" with
          payload  bytes of this rank's whole input (the block it keeps for itself included), and
          sent     bytes of the blocks it sends to the other ranks, exactly: S - input_split_sizes[r]
                   rows. With even splits that is (N-1)/N·S, ring_bytes_sent's all-to-all formula;
                   with the uneven splits a router produces no formula of S gives it.
        """
        payload = tensor_bytes(input)
        if input_split_sizes is None:
            kept = payload // self.size  # torch requires dim 0 to divide evenly
        else:
            row_bytes = math.prod(input.shape[1:]) * input.element_size()
            kept = input_split_sizes[self.rank] * row_bytes
        return self._run(
            "all_to_all", tag, payload,
            lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=self.group,
                                           async_op=async_op),
            async_op, input.is_cuda, sent_bytes=payload - kept,
        )
