"""Layer-level tests with real gloo ranks inside one pytest process.

`run_ranks(world, target, *args)` spawns `world` processes (torch.multiprocessing), joins them in
a gloo process group over a free loopback port, and calls `target(rank, world, out_dir, *args)` on
each. Each rank may write its findings as JSON to `out_dir/rank<r>.json`; `run_ranks` returns
them, rank by rank. A rank that raises fails the call with its traceback. One spawn costs a few
seconds (each process imports torch), so a test module runs all its checks in one spawn and
asserts on the collected results.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.dist.groups import exit_process

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, target, args) -> None:
    sys.path.insert(0, str(PROJECT_ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        target(rank, world, Path(out_dir), *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalisation: on torch 2.13 gloo's threads outlive
    # destroy_process_group and can abort the process at exit ("terminate called without an active
    # exception", SIGABRT) after its work is done and written (parallel/dist/groups.py: exit_process).
    exit_process(0)


def run_ranks(world: int, target, *args) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, _free_port(), out_dir, target, args), nprocs=world, join=True)
        return [json.loads(p.read_text()) if (p := Path(out_dir) / f"rank{r}.json").exists() else {}
                for r in range(world)]


def write_result(out_dir: Path, rank: int, result: dict) -> None:
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
