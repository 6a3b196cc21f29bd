"""How long a step took, on the device that ran it.

On the CPU, work is done when the call returns: a host clock around the step is the step's time.
On a GPU, calls only enqueue kernels; the host clock would measure launching them. There a pair of
CUDA events is recorded on the current stream around the step, and the elapsed time between them
is read once the end event has completed: the time the GPU spent on the step, from the first
kernel to the last (collectives included, since every collective's completion is ordered back
onto the current stream before the step's end event).
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """`start()`, run the step, `stop()` -> seconds. Nothing CUDA-related runs on the CPU path."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start_time = 0.0
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start_event.record()
        else:
            self._start_time = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end_event.record()
            self._end_event.synchronize()
            return self._start_event.elapsed_time(self._end_event) / 1e3  # elapsed_time is in ms
        return time.perf_counter() - self._start_time


class StepClock:
    """Timestamps within one step, on the same axis as the step's own time: the breakdown and the
    trace place every phase and every communication call of a step on it.

    `now()` is a stamp: the host's perf_counter on the CPU; on a GPU a CUDA event recorded on the
    current stream, so that a phase lasts as long as the stream spent on it (as `StepTimer` does
    for the whole step). `seconds(stamp)` is the time from the step's origin to the stamp: for an
    event, read once it has completed (after the step). A float stamp taken on a GPU (PyTorch's
    own collectives, timed by the baselines' counters on the host) is placed by host time from the
    origin: approximate, since the host runs ahead of the stream.

    `origin_wall` is the wall-clock time of the origin: it places the steps of different ranks of
    one machine on one axis (ranks on different machines are as aligned as their clocks).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.origin_wall = 0.0
        self._origin_host = 0.0
        self._origin_event = None

    def begin_step(self) -> None:
        self.origin_wall = time.time()
        self._origin_host = time.perf_counter()
        if self.cuda:
            self._origin_event = self.now()

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self._origin_host
        stamp.synchronize()
        return self._origin_event.elapsed_time(stamp) / 1e3


def default_warmup_steps(steps_run: int) -> int:
    """`train.warmup_steps=null`: min(3, steps_run // 2) untimed steps (allocator, caches, lazy
    init), so that at least half of the steps a run takes are timed, and a run of one step is."""
    return min(3, steps_run // 2)
