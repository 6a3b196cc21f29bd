"""What one gloo call costs on this machine, call by call: the distribution behind the loopback link model.

    torchrun --standalone --nproc-per-node 2 -m lab.gloo_call_costs [calls=150] [sizes_kib=2,16,128,1024]
        [burst_ms=0.5] [policies=normal,batch]

Two ranks, a core each. For each size and each gloo event-loop policy (`train.gloo_loop_policy`,
parallel/dist/gloo_loop.py; both in the same two processes, one after the other), `calls`
blocking all-reduces, each after `burst_ms` of matmuls on both ranks (the probe's pattern,
parallel/replay/probe.py), and then the same size as a send/receive ping-pong. Printed per size
and policy: the 10th, 50th and 90th percentiles, the mean, and the share of calls over 3 ms.
Beside them, rank 0 times a plain TCP ping-pong of 16 KiB with a child process over the loopback
device, the kernel's own cost with no gloo in the way.

Why: the replay's loopback model is one latency and one rate (a call's mean). Under the kernel's
default policy gloo's calls can have a heavy tail, a share of calls that take a scheduler tick
whatever their size (gloo's event-loop thread spins on a lock whose holder it took the core from),
and that share can move from one run to the next; this shows whether a host has it and whether
`batch` removes it. `taskset -c 0 torchrun ...` (both ranks on one core) shows the mechanism alone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from parallel.dist.gloo_loop import GLOO_LOOP_POLICIES, apply_gloo_loop_policy
from parallel.dist.groups import exit_process

TCP_PORT_OFFSET = 7  # the ping-pong's port: MASTER_PORT + this


def percentiles(ms: list[float]) -> dict:
    ms = sorted(ms)
    n = len(ms)
    return {"p10": round(ms[n // 10], 3), "p50": round(ms[n // 2], 3), "p90": round(ms[9 * n // 10], 3),
            "mean": round(sum(ms) / n, 3), "over_3ms": round(sum(x > 3 for x in ms) / n, 2)}


def burst(a: torch.Tensor, seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        a @ a


def all_reduces(t: torch.Tensor, calls: int, burst_s: float) -> list[float]:
    a, out = torch.ones(96, 96), []
    dist.all_reduce(t)
    for _ in range(calls):
        burst(a, burst_s)
        start = time.perf_counter()
        dist.all_reduce(t)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def ping_pongs(t: torch.Tensor, calls: int) -> list[float]:
    rank, out = dist.get_rank(), []
    dist.barrier()
    for _ in range(calls):
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def tcp_ping_pong(calls: int, nbytes: int = 16 * 1024) -> list[float]:
    """A plain TCP ping-pong over 127.0.0.1 between this process and a forked child (TCP_NODELAY)."""
    port = int(os.environ.get("MASTER_PORT", "29500")) + TCP_PORT_OFFSET
    msg = b"x" * nbytes
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(1)
    child = os.fork()
    if child == 0:  # the echoing end
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(calls):
            got = 0
            while got < nbytes:
                got += len(conn.recv(1 << 16))
            conn.sendall(msg)
        os._exit(0)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        conn.sendall(msg)
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 16))
        out.append((time.perf_counter() - start) * 1e3)
    os.waitpid(child, 0)
    conn.close()
    server.close()
    return out


def main(argv: list[str]) -> None:
    opts = {"calls": "150", "sizes_kib": "2,16,128,1024", "burst_ms": "0.5", "policies": "normal,batch"}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option {key!r}: {', '.join(opts)}")
        opts[key] = value
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_world_size() != 2:
        raise SystemExit("run it with --nproc-per-node 2: two ranks, a core each")
    calls, burst_s = int(opts["calls"]), float(opts["burst_ms"]) * 1e-3
    policies = opts["policies"].split(",")
    for policy in policies:
        if policy not in GLOO_LOOP_POLICIES:
            raise SystemExit(f"policies={opts['policies']!r}: each one of {', '.join(GLOO_LOOP_POLICIES)}")
    rows = {}
    for kib in (int(k) for k in opts["sizes_kib"].split(",")):
        t = torch.ones(kib * 1024 // 4)
        for policy in policies:
            apply_gloo_loop_policy(policy)
            rows[f"all_reduce {kib} KiB after {opts['burst_ms']} ms, {policy}"] = percentiles(
                all_reduces(t, calls, burst_s))
            rows[f"send/recv ping-pong {kib} KiB, {policy}"] = percentiles(ping_pongs(t, calls))
    dist.barrier()
    if dist.get_rank() == 0:
        rows["plain TCP ping-pong 16 KiB (no gloo)"] = percentiles(tcp_ping_pong(calls))
        print(f"# gloo call costs, ms, {calls} calls each, 2 ranks ({time.strftime('%Y-%m-%d %H:%M')})")
        for name, row in rows.items():
            print(f"{name:48s} {json.dumps(row)}")
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # past gloo's finalisation abort (parallel/dist/groups.py)


if __name__ == "__main__":
    main(sys.argv[1:])
