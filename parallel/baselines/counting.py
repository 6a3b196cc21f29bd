"""Counting the traffic of PyTorch's own parallelism into the same communication log.

DTensor tensor parallelism and torch.distributed.pipelining call torch.distributed themselves, not
through `comm.py`. Each has one narrow entry point through which all its step traffic passes, and
for the duration of a step the counters below wrap that entry point, record every call in the
CommLog exactly as `comm.py` would (same op names, payload and ring bytes, the group under the
project's name, the time blocked), and call the original:

  FunctionalCollectiveCounter   DTensor redistributes through the functional collectives
                                (`torch.ops._c10d_functional.all_reduce`, ...), looked up by name
                                at every call: the wrapper replaces the op in that namespace.
                                `wait_tensor` is wrapped too and its blocked time charged to the
                                collective it waits for.
  PipelineP2PCounter            torch's pipeline schedules post every send and receive of a step
                                through `schedules._batch_p2p` and wait on them through
                                `schedules._wait_batch_p2p`: both are wrapped. A send is tagged
                                with its ends, `pipelining/send/<src>-><dst>` (group ranks).
  RoutedAllReduce               FSDP2's HSDP all-reduces each gradient shard over the replicate
                                group with a plain `dist.all_reduce` in its collectives module
                                (it has custom hooks for its all-gathers and reduce-scatters, not
                                for this): that module's `dist` is replaced by one whose
                                `all_reduce` is the run's Communicator's, which logs and issues it.

Why not a TorchDispatchMode (what torch's CommDebugMode does)? It sees every collective too, but
it puts Python on the path of every operator of the step, DTensor's local ops included, and so
slows the step it counts. A counter that slows a baseline would flatter our strategies; the
wrappers touch only the few dozen communication calls of a step, and their cost does not stand
out of a step's noise (bench/tp_vs_dtensor.py prints counted against uncounted torch_tp steps).

For the replay (parallel/replay/), each span also carries the thread's CPU time (comm.py) and
what it really is: a functional collective returns at once and `wait_tensor` waits for it (the
wait names its post); torch's pipeline posts its sends and receives in `_batch_p2p` (drawn as
blocking calls, as before, but marked `posted`) and `_wait_batch_p2p` waits for the batch it is
given (the wait names that batch's posts).

Time is read as comm.py reads its own calls': on the CPU by the host clock, where a call's work is
done when it returns; on a GPU by CUDA events on the current stream (commlog.DeviceInterval), the
stream that runs the step's compute, read at the step's end. A functional collective or a batch of
p2p posts runs on NCCL's stream and holds the current one for nothing; `wait_tensor` and
`_wait_batch_p2p` make it wait for them: that wait is the exposed communication (and, for the
pipeline's receives, the bubble), and what NCCL's stream did meanwhile stays hidden.

A call on a process group that is none of the run's communicators raises: its traffic could not
be placed in a group. Not counted: torch pipelining's one-time metadata exchange on the first step
(shapes and dtypes as pickled objects through send_object_list), which is setup, not step traffic.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel.dist.comm import CommLog, Communicator, DeviceInterval, tensor_bytes
from parallel.dist.timing import cpu_stamp

# functional op -> (the project's op name, payload rule): "input" the input tensor (an all-reduce's
# tensor, a reduce-scatter's full input), "gathered" input x group size (an all-gather's full output)
FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_gather_into_tensor": ("all_gather", "gathered"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
}


class HostInterval:
    """A call timed by the host clock: on the CPU its work is done when it returns."""

    def __init__(self):
        self._start, self._end = time.perf_counter(), None

    def stop(self) -> HostInterval:
        self._end = time.perf_counter()
        return self

    def stamps(self) -> tuple[float, float]:
        return self._start, self._end

    def seconds(self) -> float:
        return self._end - self._start


def call_interval(cuda: bool) -> HostInterval | DeviceInterval:
    """Start timing a call on the clock of the device its tensors are on (see the module)."""
    return DeviceInterval() if cuda else HostInterval()


def charge(log: CommLog, key: tuple[str, str, str], interval: HostInterval | DeviceInterval) -> None:
    """The time the call held its caller into the call's record (op, group, tag): the host's at once,
    CUDA events' at the step's end (reading them now would synchronise)."""
    if not log.timed:
        return
    if isinstance(interval, DeviceInterval):
        log.add_device_interval(*key, interval)
    else:
        log.add_seconds(*key, interval.seconds())


class _GroupNames:
    """Process group name -> (the run's name for it, its size)."""

    def __init__(self, comms: list[Communicator]):
        self.by_name = {c.group.group_name: (c.name, c.size) for c in comms if c is not None}

    def __call__(self, group_name: str) -> tuple[str, int]:
        if group_name not in self.by_name:
            raise RuntimeError(f"a collective on process group {group_name!r}, which is none of the run's "
                               f"communicators ({sorted(self.by_name)}): its traffic could not be placed")
        return self.by_name[group_name]


class FunctionalCollectiveCounter:
    """Within `with`: every functional collective DTensor issues is recorded under `<prefix>/<op>`."""

    def __init__(self, log: CommLog, comms: list[Communicator], tag_prefix: str):
        self.log = log
        self.groups = _GroupNames(comms)
        self.prefix = tag_prefix
        self._namespace = torch.ops._c10d_functional
        self._originals: dict[str, object] = {}
        # id(output) -> the record its wait is charged to, and its span
        self._awaiting: dict[int, tuple[tuple[str, str, str], int | None]] = {}

    def __enter__(self):
        for name, (op, rule) in FUNCTIONAL_OPS.items():
            original = getattr(self._namespace, name)
            self._originals[name] = original
            setattr(self._namespace, name, self._counted(original, op, rule))
        wait = self._namespace.wait_tensor
        self._originals["wait_tensor"] = wait
        self._namespace.wait_tensor = self._timed_wait(wait)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(self._namespace, name, original)
        self._originals.clear()
        self._awaiting.clear()
        return False

    def _counted(self, original, op: str, rule: str):
        def call(tensor, *args):
            group, size = self.groups(args[-1])  # the group name is every functional collective's last argument
            payload = tensor_bytes(tensor) * (size if rule == "gathered" else 1)
            interval, cpu_start = call_interval(tensor.is_cuda), cpu_stamp()
            out = original(tensor, *args)
            interval.stop()
            tag = f"{self.prefix}/{op}"
            entry = self.log.record(op, group, tag, payload, size)
            charge(self.log, (op, group, tag), interval)
            span_id = self.log.span("call", op, group, tag, *interval.stamps(), entry, cpu_start=cpu_start,
                                    posted=True)
            self._awaiting[id(out)] = ((op, group, tag), span_id)
            return out

        return call

    def _timed_wait(self, original):
        def call(tensor):
            interval, cpu_start = call_interval(tensor.is_cuda), cpu_stamp()
            out = original(tensor)
            interval.stop()
            awaited = self._awaiting.pop(id(tensor), None)
            if awaited is not None and self.log.timed:
                key, span_id = awaited
                charge(self.log, key, interval)
                self.log.span("wait", *key, *interval.stamps(), cpu_start=cpu_start,
                              waits=() if span_id is None else (span_id,))
            return out

        return call


class PipelineP2PCounter:
    """Within `with`: every send and receive torch's pipeline schedules post is recorded under
    `<prefix>/send|recv`, and the time blocked waiting for them is charged to them. `cuda`: the
    stages run on a GPU (a batch's own tensors say so; this is for a wait on works of no batch
    seen)."""

    def __init__(self, log: CommLog, comms: list[Communicator], tag_prefix: str, cuda: bool = False):
        from torch.distributed.pipelining import schedules

        self.log = log
        self.groups = _GroupNames(comms)
        self.prefix = tag_prefix
        self.cuda = cuda
        self._module = schedules
        self._originals: dict[str, object] = {}
        self._batches: dict[int, tuple[list[int], bool]] = {}  # id(works of a batch) -> its posts' spans, on CUDA

    def __enter__(self):
        for name, wrap in (("_batch_p2p", self._counted), ("_wait_batch_p2p", self._timed_wait)):
            original = getattr(self._module, name)
            self._originals[name] = original
            setattr(self._module, name, wrap(original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(self._module, name, original)
        self._originals.clear()
        return False

    @staticmethod
    def op_stamps(interval: HostInterval | DeviceInterval, n: int) -> list[tuple]:
        """Each op of a batch its piece of the batch's posting time, one after the other: an equal
        share of the host's on the CPU; on a GPU, whose events cannot be cut, all of it to the first
        op and none (at its end) to the others, so that the batch is counted once."""
        start, end = interval.stamps()
        if isinstance(interval, DeviceInterval):
            return [(start, end)] + [(end, end)] * (n - 1)
        share = (end - start) / max(n, 1)
        return [(start + i * share, start + (i + 1) * share) for i in range(n)]

    def _counted(self, original):
        def call(p2p_ops, *args, **kwargs):
            cuda = any(p.tensor.is_cuda for p in p2p_ops)
            interval, cpu_start = call_interval(cuda), cpu_stamp()
            works = original(p2p_ops, *args, **kwargs)
            interval.stop()
            span_ids = []
            for i, (p, (start, end)) in enumerate(zip(p2p_ops, self.op_stamps(interval, len(p2p_ops)))):
                kind = "send" if p.op is dist.isend else "recv"
                group, size = self.groups((p.group or dist.group.WORLD).group_name)
                # A send's tag names its ends (group ranks), as ours do: the link it crosses (parallel/net/predict.py).
                tag = (f"{self.prefix}/send/{dist.get_rank(p.group)}->{p.group_peer}" if kind == "send"
                       else f"{self.prefix}/recv")
                seconds = end - start if self.log.timed and not cuda else 0.0
                entry = self.log.record(kind, group, tag, tensor_bytes(p.tensor), size, seconds)
                if cuda and i == 0:
                    charge(self.log, (kind, group, tag), interval)
                peer = dist.get_global_rank(p.group or dist.group.WORLD, p.group_peer)
                span_ids.append(self.log.span("call", kind, group, tag, start, end, entry, cpu_start=cpu_start,
                                              peer=peer, posted=True))
            self._batches[id(works)] = ([i for i in span_ids if i is not None], cuda)
            return works

        return call

    def _timed_wait(self, original):
        def call(works, *args, **kwargs):
            waits, cuda = self._batches.pop(id(works), ((), self.cuda))
            interval, cpu_start = call_interval(cuda), cpu_stamp()
            out = original(works, *args, **kwargs)
            interval.stop()
            if self.log.timed and self.groups.by_name:
                group = next(iter(self.groups.by_name.values()))[0]
                # Which op a finished batch was cannot be told from its Work objects: waiting is
                # charged to the receives, which are what a pipeline stage waits for.
                key = ("recv", group, f"{self.prefix}/recv")
                charge(self.log, key, interval)
                self.log.span("wait", *key, *interval.stamps(), cpu_start=cpu_start, waits=waits)
            return out

        return call


class _DistWithRoutedAllReduce:
    """torch.distributed, except that `all_reduce` goes through the run's Communicator of its group."""

    def __init__(self, original, comms: list[Communicator], tag: str, call_context):
        self._original, self._tag, self._call_context = original, tag, call_context
        self._by_name = {c.group.group_name: c for c in comms if c is not None}

    def __getattr__(self, name):
        return getattr(self._original, name)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        comm = self._by_name.get((group or dist.group.WORLD).group_name)
        if comm is None:
            raise RuntimeError(f"an all-reduce on process group {group!r}, which is none of the run's communicators "
                               f"({sorted(self._by_name)}): its traffic could not be placed")
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"{self._tag}: expected a SUM all-reduce, got {op}")
        with self._call_context(comm, tensor):
            return comm.all_reduce(tensor, tag=self._tag, async_op=async_op)


class RoutedAllReduce:
    """Within `with`: `module`'s `dist.all_reduce` calls go through the run's Communicators, tagged `tag`.
    `call_context(comm, tensor)`: the context each call runs in (FSDP2's: untimed inside its CUDA
    side streams)."""

    def __init__(self, module, comms: list[Communicator], tag: str, call_context):
        self.module, self.comms, self.tag, self.call_context = module, comms, tag, call_context
        self._original = None

    def __enter__(self):
        self._original = self.module.dist
        self.module.dist = _DistWithRoutedAllReduce(self._original, self.comms, self.tag, self.call_context)
        return self

    def __exit__(self, *exc):
        self.module.dist = self._original
        return False


def counted_bf16_compress_hook(comm: Communicator):
    """PyTorch's own DDP hook `bf16_compress_hook` (cast the bucket to bf16, divide by the group's
    size, all-reduce, copy back), its all-reduce recorded as comm.py records one: the bucket's bytes
    in bf16, under `grads/bucket<i>`, and the post as a span. The hook leaves the mean of the
    gradients; the project's gradients are sums (every microbatch loss is already divided by the
    global token count), so the result is multiplied by the size again, as dp's bf16 sync does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    def hook(process_group, bucket):
        tag = f"grads/bucket{bucket.index()}"
        payload = bucket.buffer().numel() * torch.finfo(torch.bfloat16).bits // 8
        interval, cpu_start = call_interval(bucket.buffer().is_cuda), cpu_stamp()
        future = bf16_compress_hook(process_group, bucket)
        interval.stop()
        entry = comm.log.record("all_reduce", comm.name, tag, payload, comm.size)
        comm.log.span("post", "all_reduce", comm.name, tag, *interval.stamps(), entry, cpu_start=cpu_start)
        return future.then(lambda done: done.value().mul_(comm.size))

    return hook
