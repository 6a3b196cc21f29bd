"""What the sweep's parent knows of the machine's GPUs, asked without a CUDA context of its own.

launch.compare's parent lives for the whole sweep. A CUDA context in it would hold memory on GPU 0
all along and, on GPUs in exclusive-process mode, keep rank 0 of every run off its GPU; and a
process forked from one with CUDA initialised cannot use CUDA at all (the pool's ranks,
launch/forkserver.py, fork every run). So the parent never calls into CUDA, not even
`torch.cuda.is_available()` (torch 2.13 asks cudaGetDeviceCount, which initialises the driver):

  torch.backends.cuda.is_built()   whether this torch has CUDA at all: a flag of the build, no call
                                   into the driver (a CPU build stops here, with nothing to ask)
  one child process                `python -m parallel.compare.devices <dtype>`: it asks CUDA for
                                   the GPUs' count and names and, for a sweep that measures it, GPU
                                   0's peak FLOP/s in the runs' dtype, prints them as one JSON
                                   line, and exits, taking its context with it

`Machine` holds the answer: the device type the runs will use, the GPUs, a name for the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import torch

from parallel.report.mfu import PEAK_DTYPES, measure_peak_flops, usable_cores

PROBE_TIMEOUT_S = 300.0  # CUDA's start-up and a peak matmul; a child past this is a broken driver


@dataclass(frozen=True)
class Machine:
    device_type: str  # "cuda" where a GPU is visible, else "cpu": what the runs will use
    gpus: int
    name: str  # GPU 0's name, or the CPU and its usable cores
    peak_flops: float | None = None  # GPU 0's, measured in the child when asked

    @property
    def capacity(self) -> tuple[int, str]:
        """What the ranks of one run share on this machine: its GPUs, or its usable cores."""
        return (self.gpus, "GPUs") if self.device_type == "cuda" else (usable_cores(), "cores")


def probe_command(peak_dtype: str | None) -> list[str]:
    """The child that asks CUDA; `peak_dtype` (a train.precision) also measures GPU 0's peak in it."""
    return [sys.executable, "-m", "parallel.compare.devices", peak_dtype or "none"]


def sweep_machine(peak_dtype: str | None = None, command: list[str] | None = None) -> Machine:
    """The machine, asked without initialising CUDA in this process (see the module)."""
    cpu = Machine("cpu", 0, f"cpu ({usable_cores()} cores)")
    if not torch.backends.cuda.is_built():
        return cpu
    done = subprocess.run(command or probe_command(peak_dtype), capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT_S, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"asking CUDA for the GPUs failed in a child process (exit {done.returncode}): {said}")
    facts = json.loads(lines[-1])
    if not facts["gpus"]:
        return cpu
    return Machine("cuda", facts["gpus"], facts["names"][0], facts["peak_flops"])


def probe(peak_dtype: str) -> dict:
    """In the child: the visible GPUs and, where asked and one is there, GPU 0's peak FLOP/s."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    peak = None
    if gpus and peak_dtype != "none":
        peak = measure_peak_flops(torch.device("cuda", 0), dtype=PEAK_DTYPES[peak_dtype])
    return {"gpus": gpus, "names": [torch.cuda.get_device_name(i) for i in range(gpus)], "peak_flops": peak}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])), flush=True)
