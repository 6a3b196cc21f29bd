"""The loopback probe's figures two ways from the same calls: from the later of the two posts (the
probe's method, parallel/replay/probe.py) and from each rank's own post (its method until
2026-12-02 21:00, rank 0's mean call time).

    python bench/probe_from_last_post.py [runs=5]

Each run is one pair of processes under torchrun, bound a core each, that makes the probe's calls
(16 KiB and 8 MiB all-reduces, 16 KiB ping-pongs, each after a burst of L2-sized matmuls) and
stamps every call's post and end on the host's monotonic clock. Printed per run: both sets of
figures (GB/s, µs per ring step, µs per message) and the mean distance between the two ranks'
posts of a small all-reduce: the wait for the other's burst, which a rank's own call time holds
and the replay, which starts an op at its last post, does not charge to the link. The medians
of the runs close the table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def figures(t_small: float, t_big: float, t_pp: float) -> list[float]:
    """(GB/s, µs per ring step, µs per message) from the three mean call times, as the probe solves them."""
    from parallel.replay.probe import PAYLOAD_BYTES, SMALL_BYTES
    rate = (PAYLOAD_BYTES - SMALL_BYTES) / max(t_big - t_small, 1e-9)
    latency = max((t_small - SMALL_BYTES / rate) / 2, 1e-6)
    p2p = max(t_pp / 2 - SMALL_BYTES / rate, 1e-6)
    return [rate / 1e9, latency * 1e6, p2p * 1e6]


def pair() -> None:
    """Under torchrun with 2 ranks: one probe's calls, both estimators, a JSON line on rank 0."""
    import torch
    import torch.distributed as dist

    from parallel.dist.binding import bind_rank, machine_id
    from parallel.dist.gloo_loop import apply_gloo_loop_policy
    from parallel.replay import probe

    dist.init_process_group("gloo")
    apply_gloo_loop_policy("batch")
    torch.set_num_threads(1)
    bind_rank("auto", [machine_id()] * 2, dist.get_rank(), 1, "cpu")
    small, big = torch.ones(probe.SMALL_BYTES // 4), torch.ones(probe.PAYLOAD_BYTES // 4)
    dist.all_reduce(big)
    dist.all_reduce(small)
    first = dist.get_rank() == 0

    def ping_pong():
        if first:
            dist.send(small, 1)
            dist.recv(small, 1)
        else:
            dist.recv(small, 0)
            dist.send(small, 0)

    ping_pong()
    burst = probe.burst_matrix()
    calls = [probe.pair_stamps(probe.stamps_after_compute(fn, n, burst)) for fn, n in
             [(lambda: dist.all_reduce(small), probe.SMALL_REPEATS), (lambda: dist.all_reduce(big), probe.BIG_REPEATS),
              (ping_pong, probe.P2P_REPEATS)]]
    if first:
        own = [float((c[0][:, 1] - c[0][:, 0]).mean()) for c in calls]
        last = [probe.from_last_post(calls[0]), probe.from_last_post(calls[1]),
                probe.from_last_post(calls[2], end_of="first")]
        apart = float((calls[0][0][:, 0] - calls[0][1][:, 0]).abs().mean())
        print(json.dumps({"last": figures(*last), "own": figures(*own), "posts_apart_us": apart * 1e6}))
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    runs = int(dict(a.split("=", 1) for a in argv).get("runs", 5))
    rows = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               __file__, "pair"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not line:
            raise SystemExit(f"probe pair failed: {proc.stderr[-800:]}")
        rows.append(json.loads(line[-1]))
    print("| run | from the later post (GB/s, µs per ring step, µs per message) | from the rank's own post "
          "| posts apart (µs) |")
    print("|---|---|---|---|")
    show = lambda f: f"{f[0]:.2f}, {f[1]:.0f}, {f[2]:.0f}"  # noqa: E731
    for i, r in enumerate(rows):
        print(f"| {i} | {show(r['last'])} | {show(r['own'])} | {r['posts_apart_us']:.0f} |")
    med = lambda key: [statistics.median(r[key][j] for r in rows) for j in range(3)]  # noqa: E731
    print(f"| median | {show(med('last'))} | {show(med('own'))} | "
          f"{statistics.median(r['posts_apart_us'] for r in rows):.0f} |")


if __name__ == "__main__":
    if sys.argv[1:] == ["pair"]:
        pair()
    else:
        main(sys.argv[1:])
