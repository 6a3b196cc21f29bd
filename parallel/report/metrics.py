"""Where a run writes: its directory, each rank's log file, metrics.jsonl, and atomic JSON.

summary.json, the one output schema of every run, is assembled in parallel/report/summary.py.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch


def default_run_dir(strategy: str, world_size: int) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{strategy}-w{world_size}-{os.getpid() % 0x10000:04x}")


def setup_logging(run_dir: Path, rank: int, append: bool = False) -> logging.Logger:
    """Each rank logs to its own file; only rank 0 also talks to the console."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log", mode="a" if append else "w")
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(name)s: %(message)s"))
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(console)
    return logging.getLogger("parallel")


def close_logging() -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        handler.flush()
        handler.close()
        root.removeHandler(handler)


def reset_peak_memory(device: torch.device) -> bool:
    """Start the CUDA allocator's peak afresh, at the first timed step: from there on
    `peak_memory_bytes` is the timed steps' peak (what the steps hold: the model, its state, a
    step's activations), not model construction's, ZeRO's flattening's or the warm-up's. True
    where it reset one. On the CPU nothing: the kernel's peak RSS (ru_maxrss) cannot be reset, so
    it stays the process's peak since it started."""
    if device.type != "cuda":
        return False
    torch.cuda.reset_peak_memory_stats(device)
    return True


def peak_memory_scope(device_type: str) -> str:
    """What `peak_memory_bytes` covers on this device, in words (summary.json's peak_memory_scope)."""
    if device_type == "cuda":
        return "the timed steps: the CUDA allocator's peak, reset at the first step after the warm-up"
    return "the whole process: peak RSS since it started (the kernel's figure cannot be reset)"


def peak_memory_bytes(device: torch.device) -> int:
    """The allocator's peak on a GPU (since `reset_peak_memory`), the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MetricsWriter:
    """metrics.jsonl: one line per step, written by rank 0 as the run goes."""

    def __init__(self, path: Path, append: bool = False):
        self._file = open(path, "a" if append else "w")  # append: a restarted job's later attempt

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_json(path: Path, obj: dict) -> None:
    """Write through a temporary file and rename, so a reader never sees half a summary."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
