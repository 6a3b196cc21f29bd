"""Check parallel/net/predict.py's rules against the wire: each gloo collective alone, on 2 emulated
nodes of 2 ranks (needs root, like launch.run), bytes counted by the links' interfaces.

    python -m lab.gloo_wire              # prints the table of docs on the network's bytes, "Checking the rules"

For each op, on three kinds of group (pairs across the nodes {0,2},{1,3}; pairs inside them
{0,1},{2,3}; the whole world), 20 calls on a 4 MiB tensor between two readings of the counters
(barrier, read, barrier: docs/network.md), and the same calls through predict.step_bytes.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from functools import partial

from launch.config import CODE_ROOT

CALLS = 20
NBYTES = 4 << 20


def worker() -> None:
    import torch
    import torch.distributed as dist

    from parallel.dist.groups import exit_process
    from parallel.net import counters, predict

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    node_of = {r: r // per_node for r in range(world)}
    groups = {"world": (dist.group.WORLD, list(range(world)))}
    for name, layouts in (("across", [[0, 2], [1, 3]]), ("inside", [[0, 1], [2, 3]])):
        for ranks in layouts:
            g = dist.new_group(ranks)
            if rank in ranks:
                groups[name] = (g, ranks)
    mtu = {"inter": counters.mtu("net0"), "intra": counters.mtu("lo")}

    def reading():
        dist.barrier()
        r = {"inter": counters.read("net0")["tx_bytes"], "intra": counters.read("lo")["tx_bytes"]}
        dist.barrier()
        return r

    full = torch.ones(NBYTES // 4)
    for group_name, (group, members) in groups.items():
        n = len(members)
        shard = torch.ones(NBYTES // 4 // n)
        ops = {
            "all_reduce": partial(dist.all_reduce, full, group=group),
            "reduce_scatter": partial(dist.reduce_scatter_tensor, shard, full, group=group),
            "all_gather": partial(dist.all_gather_into_tensor, full, shard, group=group),
            "broadcast": partial(dist.broadcast, full, group_src=0, group=group),
        }
        for op, call in ops.items():
            before = reading()
            for _ in range(CALLS):
                call()
            after = reading()
            measured = {k: after[k] - before[k] for k in after}
            mine = predict.step_bytes({(op, group_name, "bench"): {"calls": CALLS, "payload_bytes": CALLS * NBYTES}},
                                      {group_name: members}, rank, node_of, mtu)
            rows = [None] * world
            dist.all_gather_object(rows, (node_of[rank], rank, measured, mine))
            if rank == 0:
                first = {}
                for node, _r, m, _ in rows:
                    first.setdefault(node, m)  # one reading per node
                wire = {k: sum(m[k] for m in first.values()) / CALLS / NBYTES for k in ("inter", "intra")}
                pred = {k: sum(p[k]["wire"] for *_, p in rows) / CALLS / NBYTES for k in ("inter", "intra")}
                print(f"| {op} | {group_name} ({n}) | {wire['inter']:.3f} | {pred['inter']:.3f} "
                      f"| {wire['intra']:.3f} | {pred['intra']:.3f} |", flush=True)
    dist.destroy_process_group()
    exit_process(0)  # past gloo's finalisation abort (parallel/dist/groups.py)


def main() -> None:
    from parallel.net.netns import EmulatedNetwork
    from parallel.net.topology import NODE_IF, NetSpec

    spec = NetSpec.from_config({"name": "bench", "nodes": 2, "procs_per_node": 2, "inter_mbit": 1000,
                                "intra_mbit": 10000, "latency_ms": 0, "loss_pct": 0, "timeout_s": 600})
    print("| op | groups (size) | inter wire / S | inter predicted / S | intra wire / S | intra predicted / S |")
    print("| --- | --- | --- | --- | --- | --- |")
    with EmulatedNetwork(spec) as net:
        addrs = [net.names.address(k) for k in range(spec.nodes)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": NODE_IF, "PYTHONPATH": str(CODE_ROOT)}
        procs = [subprocess.Popen(net.node_command(k, [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={spec.nodes}", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={addrs[0]}:29400", "--rdzv-id=gloo_wire",
            f"--local-addr={addrs[k]}",
            f"--rdzv-conf=is_host={int(k == 0)}", "--monitor-interval=1", "-m", "lab.gloo_wire", "--worker"]),
            cwd=CODE_ROOT, env=env, stderr=subprocess.DEVNULL) for k in range(spec.nodes)]
        for p in procs:
            p.wait(timeout=600)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
