"""The communication log: every call of a run's communicators, summed per step, and the last
step's calls as spans.

Every call is recorded (`CommLog.record`) with:
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

Each span also carries the second clock: the CPU time of the calling thread (`time.thread_time()`,
parallel/dist/timing.py) at its start and end, the thread that runs the rank's compute, and beside
it the CPU time of the rank's other threads (gloo's), which the replay charges to the ops in
flight. With it the replay (parallel/replay/) rebuilds the step as if the rank had a core of its
own: the compute between two calls is the CPU time between them, which does not advance while the
thread waits for a core or blocks in a call. A span also names its peer (global rank) for a send
or receive, its id, and for a wait the ids of the posts it waits for, so that the replay can pair
every wait with its post.

Nothing here calls torch.distributed: the calls themselves are made by comm.py's Communicator.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from fractions import Fraction

import torch

from parallel.dist.flight import FlightRecorder
from parallel.dist.timing import cpu_stamp
from parallel.dist.traffic import StepTraffic, Totals, ring_bytes_sent


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
        self._unresolved: list[tuple[Totals, DeviceInterval]] = []
        # The step's spans: (kind, op, group, tag, payload, sent, start stamp, end stamp, cpu start, cpu
        # end, peer, waits, posted), kind "call" (blocking), "post" (an async call returning at once)
        # or "wait" (for an async call). A span's id is unique in the run (`_span_base` + its index in
        # the step), so a wait for a post of an earlier step never names one of this step's.
        self.clock = None  # a StepClock, set by the training loop; None: no spans
        self._spans: list[tuple] = []
        self._span_base = 0
        self._in_step = False
        self.last_spans: list[dict] = []  # the last finished step's, resolved (seconds from its origin)
        # The rank's last calls, always kept, whatever `enabled` says (flight.py): what a hang dumps.
        self.flight = FlightRecorder()

    @property
    def spanning(self) -> bool:
        """Whether calls made now are kept as spans (timed, inside a step, with a clock)."""
        return self._in_step and self.timed and self.clock is not None

    @contextlib.contextmanager
    def untimed(self):
        """Calls made within are recorded (their bytes) but neither timed nor drawn as spans: calls
        that run on a stream of their own, which the step's stream waits for elsewhere (FSDP2's
        collectives on CUDA), so that their time would be the side stream's, not the step's wait."""
        timed, self.timed = self.timed, False
        try:
            yield self
        finally:
            self.timed = timed

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

    def add_device_interval(self, op: str, group: str, tag: str, interval: DeviceInterval) -> None:
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

    def stop(self) -> DeviceInterval:
        self._end.record()
        return self

    def stamps(self) -> tuple:
        """The two events, as StepClock stamps of the call's span."""
        return self._start, self._end

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3
