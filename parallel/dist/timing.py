"""How long a step took, on the device that ran it.

On the CPU, work is done when the call returns: a host clock around the step is the step's time.
On a GPU, calls only enqueue kernels; the host clock would measure launching them. There a pair of
CUDA events is recorded on the current stream around the step, and the elapsed time between them
is read once the end event has completed: the time the GPU spent on the step, from the first
kernel to the last (collectives included, since every collective's completion is ordered back
onto the current stream before the step's end event).

The same clock stamps the step's phases and communication calls (StepClock), so that the time
breakdown (parallel/report/breakdown.py) divides exactly the time measured.

Beside the wall clock, the step has a second one: the CPU time of the thread that runs the rank's
compute (`time.thread_time()`, CLOCK_THREAD_CPUTIME_ID), read at the step's origin and end and at
every phase mark and call. With one intra-op thread per rank (the training loop sets it), CPU
autograd running backward on the thread that called it, and gloo's own threads (which move the
bytes) left out, it is the rank's compute as one dedicated core would take it: it does not advance
while the thread waits for a core or blocks in a call. The replay (parallel/replay/) rebuilds the
step from it. A rank of several intra-op threads has no such clock (the sum of their CPU times is
not what its cores took: parallel/replay/device.py): the replay reads its wall stamps instead.

Each stamp of that clock also reads the process's CPU time: the difference is the CPU time of the
rank's other threads, gloo's (its event loop and its worker threads, which move and reduce the
bytes), so that the replay can charge a rank's core with what its communication takes of it.
A stamp is the pair (thread, process): two `clock_gettime` calls, not one sample, so the other
threads' time of a stamp may read lower than the stamp before. And the process clock takes a
running thread's time in at the scheduler's tick or when it stops running (Linux since 4.8 leaves
out the time a thread has run since, for scalability), so a read can fall short by up to a tick
(4 ms at HZ 250) for each thread running at that moment, and a span's end may read below its
start on a busy machine. Differences over an op's life sum those
steps away; a single difference is good to a tick.
"""

from __future__ import annotations

import time

import torch


def cpu_stamp() -> tuple[float, float]:
    """A stamp of the second clock: (the compute thread's CPU time, the CPU time of the process's
    other threads)."""
    thread = time.thread_time()
    return thread, time.process_time() - thread


class StepClock:
    """The step's time, and timestamps within it on the same axis: the breakdown and the trace
    place every phase and every communication call of a step on it.

    `begin_step()` stamps the step's origin, `end_step()` its end and returns the seconds between
    (the step's time). `now()` is a stamp: the host's perf_counter on the CPU; on a GPU a CUDA
    event recorded on the current stream, so that a phase lasts as long as the stream spent on it.
    `seconds(stamp)` is the time from the origin to the stamp: for an event, read once it has
    completed. A float stamp taken on a GPU (the post of DDP's comm hook, which DDP waits for
    itself: comm.py's all_reduce_future) is placed by host time from the origin: approximate, since
    the host runs ahead of the stream. Nothing CUDA-related runs on the CPU path.

    `origin_wall` is the wall-clock time of the origin: it places the steps of different ranks of
    one machine on one axis (ranks on different machines are as aligned as their clocks).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.origin_wall = 0.0
        self.origin = None  # the step's first stamp
        self.end = None  # its last, once the step is over
        self._origin_host = 0.0
        self.origin_cpu = 0.0  # the thread's CPU time at the origin, and at the end
        self.end_cpu = 0.0
        self.origin_helpers = 0.0  # the other threads' (gloo's) CPU time at the origin, and at the end
        self.end_helpers = 0.0

    def begin_step(self) -> None:
        self.origin_wall = time.time()
        self._origin_host = time.perf_counter()
        self.origin = self.now() if self.cuda else self._origin_host
        self.origin_cpu, self.origin_helpers = cpu_stamp()
        self.end = None

    def end_step(self) -> float:
        """Stamp the step's end; its seconds (on a GPU this waits for the stream to get there)."""
        self.end = self.now()
        self.end_cpu, self.end_helpers = cpu_stamp()
        return self.seconds(self.end)

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def cpu_now() -> tuple[float, float]:
        """The second clock's stamp: (this thread's CPU time, the other threads')."""
        return cpu_stamp()

    def cpu_seconds(self, stamp: tuple[float, float]) -> float:
        """CPU seconds of the calling thread from the origin to `stamp`."""
        return stamp[0] - self.origin_cpu

    def helper_seconds(self, stamp: tuple[float, float]) -> float:
        """CPU seconds of the other threads (gloo's) from the origin to `stamp`."""
        return stamp[1] - self.origin_helpers

    def seconds(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self._origin_host
        stamp.synchronize()
        return self.origin.elapsed_time(stamp) / 1e3  # elapsed_time is in ms


class StepTimer:
    """`start()`, run the step, `stop()` -> seconds; `clock` stamps the step's phases and calls on
    the step's own axis, so that they tile exactly the time measured."""

    def __init__(self, device: torch.device):
        self.clock = StepClock(device)

    def start(self) -> None:
        self.clock.begin_step()

    def stop(self) -> float:
        return self.clock.end_step()


def default_warmup_steps(steps_run: int) -> int:
    """`train.warmup_steps=null`: min(3, steps_run // 2) untimed steps (allocator, caches, lazy
    init), so that at least half of the steps a run takes are timed, and a run of one step is."""
    return min(3, steps_run // 2)
