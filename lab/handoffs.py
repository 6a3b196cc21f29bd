"""How long a point-to-point message takes to reach a receiver that is already waiting for it.

    python -m lab.handoffs <run dir> [<run dir> ...]

Reads each run's trace.json (every rank's last step, on one wall clock: the ranks of a run on one
machine, or on its emulated nodes, share it) and matches every send a rank posted with the
receive its peer waited on, by tag and order. For each message the handoff is the time from the
moment both sides were ready (the send handed to the backend, the receiver blocked in its wait,
whichever came later) to the moment the receiver's wait returned. Printed per run: how many
messages, the handoff's median, 90th percentile and maximum in µs, their sum over the step, and
the message latency the run's virtual time used within a node (its link model's `p2p_latency_s`).

Why: on a core per rank a handoff is the link's latency or less (the data is often there before
the receiver waits). With more ranks than cores the receiver's thread, and gloo's thread that
takes the bytes off the socket, must first get a core: the kernel's scheduler lets the running
thread finish its slice before a woken one runs, so a handoff can wait milliseconds. The replay's
processor sharing (`launch.replay <run> cores=C`) gives a woken rank its share of the cores at
once, so it does not see that wait; this measures it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def handoffs_us(trace: dict) -> list[float]:
    """The handoff of every point-to-point message in a chrome trace written by a run (trace.json)."""
    posts, waits = defaultdict(list), defaultdict(list)
    seen = set()
    for e in trace["traceEvents"]:
        args = e.get("args", {})
        if e.get("ph") != "X" or args.get("op") not in ("send", "recv"):
            continue
        key = (e["pid"], e["tid"], e["ts"], e["name"])
        if key in seen:  # one batched call is listed once per op it carries
            continue
        seen.add(key)
        if args["op"] == "send" and args["kind"] == "post":
            posts[args["tag"]].append(e)
        elif args["op"] == "recv" and args["kind"] == "wait":
            waits[args["tag"]].append(e)
    out = []
    for tag, received in waits.items():
        sent = sorted(posts[tag], key=lambda e: e["ts"])
        received = sorted(received, key=lambda e: e["ts"])
        if len(sent) != len(received):
            raise ValueError(f"{tag}: {len(sent)} sends posted but {len(received)} receives waited on")
        for send, wait in zip(sent, received):
            ready = max(send["ts"] + send["dur"], wait["ts"])
            out.append(max(wait["ts"] + wait["dur"] - ready, 0.0))
    return out


def report(run_dir: Path) -> str:
    trace = json.loads((run_dir / "trace.json").read_text())
    values = sorted(handoffs_us(trace))
    if not values:
        return f"{run_dir}: no point-to-point messages in its last step"
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    summary = json.loads((run_dir / "summary.json").read_text())
    link = (summary.get("virtual") or {}).get("link_model") or {}
    # A message within a node (between nodes, on an emulated network, the inter link's adds to it).
    latency = (link.get("intra") or {}).get("p2p_latency_s")
    model = f" | the link model's message latency {latency * 1e6:.0f} µs" if latency is not None else ""
    return (f"{run_dir}: {len(values)} messages | handoff median {statistics.median(values):.0f} µs, "
            f"90th percentile {p90:.0f} µs, max {values[-1]:.0f} µs, sum {sum(values) / 1e3:.1f} ms{model}")


def main(argv: list[str]) -> int:
    if not argv or any(a.startswith("-") for a in argv):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    missing = [a for a in argv if not (Path(a) / "trace.json").exists()]
    if missing:
        print(f"error: no trace.json in {', '.join(missing)} (a run directory of launch.train or launch.run)",
              file=sys.stderr)
        return 2
    for a in argv:
        try:
            print(report(Path(a)))
        except ValueError as e:  # a trace whose sends and receives do not pair up
            print(f"error: {a}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
