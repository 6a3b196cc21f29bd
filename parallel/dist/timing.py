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
