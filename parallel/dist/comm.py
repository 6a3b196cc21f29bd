"""The only place that calls torch.distributed collectives and point-to-point ops.

Every call is recorded in a `CommLog` with:
  op            all_reduce, all_gather, reduce_scatter, broadcast, send, recv, gather_object, ...
  group         the name of the process group ("dp", "tp", "pp", "world")
  tag           which part of the model or algorithm sent it ("grads/bucket3", "tooling/loss")
  payload       bytes of the full (unsharded) tensor the collective is about
  sent          bytes one rank sends under a bandwidth-optimal (ring) algorithm, NCCL's convention;
                for an all-to-all, exactly the bytes of the blocks it sends to the other ranks
  seconds       optional time the caller was blocked in the call (or in its wait): host wall time
                on the CPU; on a GPU, CUDA events on the caller's stream (see `DeviceInterval`)

While a training step runs with a clock (parallel/dist/timing.py's StepClock, set by the training
loop), the log also keeps that step's calls as spans: when each call (or the post of an async one,
or the wait for it) started and ended, with its bytes. They are what the step's time breakdown
subtracts from its phases and what trace.json draws (parallel/report/breakdown.py, trace.py); only
the last step's are kept, so the cost is one tuple per call.

Each span also carries the second clock: the CPU time of the calling thread (`time.thread_time()`, parallel/dist/timing.py)
at its start and end, the thread that runs the rank's compute, and beside it the CPU time of the
rank's other threads (gloo's), which the replay charges to the ops in flight. With it the replay
(parallel/replay/) rebuilds the step as if the rank had a core of its own: the compute between two
calls is the CPU time between them, which does not advance while the thread waits for a core or
blocks in a call. A span also names its peer (global rank) for a send or receive, its id, and for a
wait the ids of the posts it waits for, so that the replay can pair every wait with its post.

Bytes come from shapes and dtypes, so counting never synchronises a device. Traffic that the tools
add themselves (gathering metrics, reducing the loss for the log) is tagged `tooling/...` and kept
apart from the strategy's own figures.
"""

from __future__ import annotations

import math
import pickle
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

from parallel.dist.timing import cpu_stamp

TOOLING_PREFIX = "tooling/"


def ring_bytes_sent(op: str, payload_bytes: int, group_size: int) -> Fraction:
    """Bytes one rank sends for `op` on `payload_bytes` in a bandwidth-optimal algorithm.

    docs/theory/collectives.md (nccl-tests PERFORMANCE.md): all-reduce 2(N-1)/N S; reduce-scatter, all-gather
    and all-to-all (N-1)/N S with S the full tensor; broadcast, reduce and p2p S. An exact
    Fraction, so that sums over many calls equal the closed form to the byte.
    """
    n = group_size
    if n == 1 and op not in ("send", "recv"):
        return Fraction(0)
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n) * payload_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_gather_object", "gather_object"):
        return Fraction(n - 1, n) * payload_bytes
    if op in ("broadcast", "reduce", "send", "broadcast_object"):
        return Fraction(payload_bytes)
    if op in ("recv", "barrier"):
        return Fraction(0)  # a receive sends nothing; its bytes are counted at the sender
    raise ValueError(f"no ring formula for op {op!r}")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Totals:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: Fraction = field(default_factory=Fraction)
    seconds: float = 0.0

    def add(self, other: "Totals") -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.sent_bytes += other.sent_bytes
        self.seconds += other.seconds

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "payload_bytes": self.payload_bytes,
            "sent_bytes": float(self.sent_bytes),
            "seconds": round(self.seconds, 6),
        }


# One step's traffic: (op, group, tag) -> Totals
StepTraffic = dict


class CommLog:
    """Per-step record of every call, summed by (op, group, tag).

    `enabled=False` turns recording off (the calls still happen), which is how the overhead of
    the accounting itself is measured. `timed=False` skips the clock reads.
    """

    def __init__(self, enabled: bool = True, timed: bool = True):
        self.enabled = enabled
        self.timed = enabled and timed
        self.steps: list[StepTraffic] = []
        # Calls made outside any training step (setup, the final gathering of results).
        self.outside: StepTraffic = defaultdict(Totals)
        self._current: StepTraffic = self.outside
        # GPU calls whose time is known only once their events complete: (record, interval).
        self._unresolved: list[tuple[Totals, "DeviceInterval"]] = []
        # The step's spans: (kind, op, group, tag, payload, sent, start stamp, end stamp, cpu start, cpu
        # end, peer, waits, posted), kind "call" (blocking), "post" (an async call returning at once)
        # or "wait" (for an async call). A span's id is unique in the run (`_span_base` + its index in
        # the step), so a wait for a post of an earlier step never names one of this step's.
        self.clock = None  # a StepClock, set by the training loop; None: no spans
        self._spans: list[tuple] = []
        self._span_base = 0
        self._in_step = False
        self.last_spans: list[dict] = []  # the last finished step's, resolved (seconds from its origin)

    @property
    def spanning(self) -> bool:
        """Whether calls made now are kept as spans (timed, inside a step, with a clock)."""
        return self._in_step and self.timed and self.clock is not None

    def begin_step(self) -> None:
        self._current = defaultdict(Totals)
        self._span_base += len(self._spans)
        self._spans = []
        self._in_step = True

    def end_step(self) -> StepTraffic:
        self.resolve_device_times()
        self.last_spans = self.resolve_spans()
        self._in_step = False
        traffic = dict(self._current)
        self.steps.append(traffic)
        self._current = self.outside
        return traffic

    def span(self, kind: str, op: str, group: str, tag: str, start, end, entry: Totals | None = None, *,
             cpu_start: tuple | None = None, peer: int | None = None, waits: tuple = (),
             posted: bool = False) -> int | None:
        """Keep one call's span in this step (start, end: StepClock stamps; `entry`: the call's
        record, whose bytes the span carries; none for a wait, whose call carried them); returns
        its id (None when not spanning). The CPU stamp (timing.cpu_stamp: the thread's and the other
        threads' CPU time) at the end is read here, at the start by the caller (`cpu_start`; None:
        the same as the end). `peer`: a send's or receive's
        other end (global rank); `waits`: the ids of the posts a wait waits for; `posted`: a call
        drawn as blocking (PyTorch's pipeline posts) that the replay must treat as a post."""
        if not self.spanning:
            return None
        cpu_end = cpu_stamp()
        payload, sent = (entry.payload_bytes, entry.sent_bytes) if entry is not None else (0, 0)
        self._spans.append((kind, op, group, tag, payload, sent, start, end,
                            cpu_end if cpu_start is None else cpu_start, cpu_end, peer, tuple(waits), posted))
        return self._span_base + len(self._spans) - 1

    def resolve_spans(self) -> list[dict]:
        if self.clock is None:
            return []
        seconds, cpu, helper = self.clock.seconds, self.clock.cpu_seconds, self.clock.helper_seconds
        return [{"kind": kind, "op": op, "group": group, "tag": tag, "payload_bytes": payload,
                 "sent_bytes": float(sent), "start": seconds(start), "end": seconds(end), "blocked": kind != "post",
                 "cpu_start": cpu(c0), "cpu_end": cpu(c1), "helper_start": helper(c0), "helper_end": helper(c1),
                 "id": self._span_base + i, "peer": peer, "waits": list(waits), "posted": posted}
                for i, (kind, op, group, tag, payload, sent, start, end, c0, c1, peer, waits, posted)
                in enumerate(self._spans)]

    def record(self, op: str, group: str, tag: str, payload_bytes: int, group_size: int, seconds: float = 0.0,
               sent_bytes: int | None = None) -> Totals:
        """`sent_bytes`: what this rank really sent, where the ring formula does not give it (an
        all-to-all with uneven splits); None: the ring formula on the payload."""
        sent = ring_bytes_sent(op, payload_bytes, group_size) if sent_bytes is None else Fraction(sent_bytes)
        entry = Totals(1, payload_bytes, sent, seconds)
        if self.enabled:
            self._current[(op, group, tag)].add(entry)
        return entry

    def add_seconds(self, op: str, group: str, tag: str, seconds: float) -> None:
        """Time spent waiting on an async call, charged to the call once it is known."""
        if self.enabled:
            self._current[(op, group, tag)].seconds += seconds

    def add_device_interval(self, op: str, group: str, tag: str, interval: "DeviceInterval") -> None:
        """A GPU call's time, read at the end of the step (reading it now would synchronise)."""
        if self.enabled:
            self._unresolved.append((self._current[(op, group, tag)], interval))

    def resolve_device_times(self) -> None:
        for totals, interval in self._unresolved:
            totals.seconds += interval.seconds()
        self._unresolved.clear()


class DeviceInterval:
    """Two CUDA events on the current stream around a call.

    A NCCL call returns once it is enqueued, so host time would be launch time. Its completion is
    ordered back onto the caller's stream (a blocking call, or `wait()` on an async one, makes the
    current stream wait for NCCL's), so the events measure how long the caller's stream was held by
    the call: the communication time that computation on that stream did not hide.
    """

    def __init__(self):
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> "DeviceInterval":
        self._end.record()
        return self

    def stamps(self) -> tuple:
        """The two events, as StepClock stamps of the call's span."""
        return self._start, self._end

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


def is_tooling(tag: str) -> bool:
    return tag.startswith(TOOLING_PREFIX)


def summarize_traffic(traffic: StepTraffic, include_tooling: bool = False) -> dict:
    """Sum a step's (op, group, tag) records by op, by group and by tag."""
    by = {"by_op": defaultdict(Totals), "by_group": defaultdict(Totals), "by_tag": defaultdict(Totals)}
    total = Totals()
    for (op, group, tag), t in traffic.items():
        if is_tooling(tag) != include_tooling:
            continue
        by["by_op"][op].add(t)
        by["by_group"][group].add(t)
        by["by_tag"][tag].add(t)
        total.add(t)
    return {"total": total, **{k: dict(v) for k, v in by.items()}}


def traffic_by_tag_op(traffic: StepTraffic) -> dict[str, dict[str, Totals]]:
    """tag -> op -> totals in one step, strategy traffic only: which collectives each part of the
    model made (how many all-reduces each layer did, forward and backward)."""
    nested: dict[str, dict[str, Totals]] = defaultdict(lambda: defaultdict(Totals))
    for (op, _group, tag), t in traffic.items():
        if not is_tooling(tag):
            nested[tag][op].add(t)
    return {tag: dict(sorted(ops.items())) for tag, ops in sorted(nested.items())}


def calls_by_tag_op(traffic: StepTraffic) -> dict[str, dict[str, int]]:
    """tag -> op -> calls in one step (strategy traffic only)."""
    return {tag: {op: t.calls for op, t in ops.items()} for tag, ops in traffic_by_tag_op(traffic).items()}


class CommFailure(RuntimeError):
    """A call that failed or timed out (a peer died or hangs), named by op, tag, group and peer."""


def _failed(comm: "Communicator", op: str, tag: str, error: Exception, peer: int | None = None) -> CommFailure:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # gloo's text: "[/path/to/pair.cc:553] Connection closed by peer [ip]:port. This is typically ..."
    first_line = re.sub(r"^\[[^\]]*\]\s*", "", first_line).split(". This is typically")[0]
    with_peer = f" with rank {comm.global_ranks[peer]}" if peer is not None else ""
    return CommFailure(f"{op} {tag!r} over group {comm.name} (ranks {comm.global_ranks}){with_peer}: {first_line}")


class Handle:
    """An async call's work object; `wait()` charges the time blocked to the call's record."""

    def __init__(self, work, comm: "Communicator", op: str, tag: str, cuda: bool = False, peer: int | None = None,
                 span_id: int | None = None):
        self._work = work
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
        try:
            self._work.wait()
        except RuntimeError as e:
            raise _failed(self._comm, self._op, self._tag, e, self._peer) from e
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
        try:
            work = fn()
        except RuntimeError as e:
            raise _failed(self, op, tag, e, peer) from e
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
            handle = Handle(work, self, op, tag, cuda, peer, span_id)
            self._pending.add(handle)
            return handle
        return None

    def wait_all(self) -> None:
        for handle in list(self._pending):
            handle.wait()

    @property
    def pending(self) -> int:
        return len(self._pending)

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
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        entry = self.log.record("all_reduce", self.name, tag, tensor_bytes(tensor), self.size)
        # Host time even on a GPU: DDP calls this hook from its reducer, and waits for it there, out
        # of the log's sight (the post has no wait span: the replay's rule for it is in parallel/replay/graph.py).
        self.log.span("post", "all_reduce", self.name, tag, start, time.perf_counter(), entry, cpu_start=cpu_start)
        return work.get_future().then(lambda fut: fut.value()[0])

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
            lambda: dist.reduce_scatter_single(shard_out, full_in, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op),
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
        return self._run("send", tag, tensor_bytes(tensor), lambda: fn(tensor, group_dst=dst_group_rank, group=self.group), async_op,
                         tensor.is_cuda, peer=dst_group_rank)

    def recv(self, tensor: torch.Tensor, src_group_rank: int, tag: str, async_op: bool = False):
        fn = dist.irecv if async_op else dist.recv
        return self._run("recv", tag, tensor_bytes(tensor), lambda: fn(tensor, group_src=src_group_rank, group=self.group), async_op,
                         tensor.is_cuda, peer=src_group_rank)

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
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as e:
            raise _failed(self, "batch_p2p", ops[0][3], e, ops[0][2]) from e
        end = clock.now() if clock is not None else None
        span_ids = []
        for kind, tensor, peer, tag in ops:
            entry = self.log.record(kind, self.name, tag, tensor_bytes(tensor), self.size)
            span_ids.append(self.log.span("post", kind, self.name, tag, start, end, entry, cpu_start=cpu_start,
                                          peer=self.global_ranks[peer]))
        # One work per op on gloo; NCCL may coalesce the batch into one. Waiting time is charged
        # to the op a work belongs to (the first op's, when coalesced).
        labels = [(kind, tag, peer) for kind, _, peer, tag in ops] if len(works) == len(ops) else [(ops[0][0], ops[0][3], None)] * len(works)
        cuda = any(tensor.is_cuda for _, tensor, _, _ in ops)
        ids = span_ids if len(works) == len(ops) else [span_ids[0]] * len(works)
        handles = [Handle(work, self, kind, tag, cuda, peer, span_id)
                   for work, (kind, tag, peer), span_id in zip(works, labels, ids)]
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
        # Payload as NCCL counts a gather: all ranks' contributions; here approximated by this
        # rank's pickled size times the group size (tooling traffic, reported apart).
        payload = len(pickle.dumps(obj)) * self.size
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
