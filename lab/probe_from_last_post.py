"""The loopback probe's figures two ways from the same calls: from the later of the two posts (the
probe's method, parallel/replay/probe.py) and from each rank's own post (rank 0's mean call time,
the method it replaced).

    python -m lab.probe_from_last_post [runs=5]

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

from launch.config import CODE_ROOT


def pair() -> None:
    """Under torchrun with 2 ranks: the probe's calls, both estimators, a JSON line on rank 0."""
    import torch
    import torch.distributed as dist

    from parallel.dist.binding import bind_rank, machine_id
    from parallel.dist.comm import CommLog, Communicator
    from parallel.dist.gloo_loop import apply_gloo_loop_policy
    from parallel.dist.groups import exit_process
    from parallel.replay import probe

    dist.init_process_group("gloo")
    apply_gloo_loop_policy("batch")
    torch.set_num_threads(1)
    bind_rank("auto", [machine_id()] * 2, dist.get_rank(), 1, "cpu")
    small, big, pp = probe.pair_calls(Communicator("world", dist.group.WORLD, CommLog()))
    if dist.get_rank() == 0:
        own = [float((calls[0][:, 1] - calls[0][:, 0]).mean()) for calls in (small, big, pp)]
        last = [probe.from_last_post(small), probe.from_last_post(big), probe.from_last_post(pp, end_of="first")]
        in_words = lambda f: [f[0] / 1e9, f[1] * 1e6, f[2] * 1e6]  # noqa: E731
        apart = float((small[0][:, 0] - small[1][:, 0]).abs().mean())
        print(json.dumps({"last": in_words(probe.solve(*last)), "own": in_words(probe.solve(*own)),
                          "posts_apart_us": apart * 1e6}))
    dist.destroy_process_group()
    exit_process(0)  # past gloo's finalisation abort (parallel/dist/groups.py)


def main(argv: list[str]) -> None:
    runs = int(dict(a.split("=", 1) for a in argv).get("runs", 5))
    rows = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "-m", "lab.probe_from_last_post", "pair"], cwd=CODE_ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(CODE_ROOT)})
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
