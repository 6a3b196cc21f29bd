"""The tc commands that make a veth or loopback behave like a link of a given rate, delay and loss.

Link model (docs/network.md): every node has one full-duplex link to the switch; a packet from node
A to node B leaves A's link (A's `net0` egress: A's upload) and enters B's link (the switch port
`n<B>` egress: B's download). Each direction of a link has its own rate:

    rate     tbf on the egress of BOTH ends of the veth (tbf shapes only what a device sends, so
             one end alone would shape one direction). `limit` is large (no drops from a full
             queue), `burst` a millisecond of traffic but at least one 64 KiB frame.
    delay    netem under tbf, half the one-way latency on each end, so A -> B waits latency_ms.
             Needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM); its default queue of 1000
             packets would drop traffic at high rates, so its limit is raised.
    loss     a classic-BPF filter on the switch port's egress (clsact) that matches a packet with
             probability loss_pct/100 (the kernel's per-packet random number, SKF_AD_RANDOM) and
             redirects it (act_mirred) into a sink veth whose far end discards it: each packet
             between two nodes meets exactly one lossy point. This needs no netem.
    intra    tbf on the node's loopback: the node's ranks share one intra-node link of intra_mbit
             (every packet between two ranks of a node crosses `lo` once).

Mid-run changes (faults.py): a link set down at the switch port (a pulled cable), a loss filter
added, and a latency spike: the link's tbf is changed to a near-zero rate for spike_ms and back,
so whatever it sends in that window waits (tbf keeps its queue across a change).
"""

from __future__ import annotations

import re
import subprocess

from parallel.net.topology import MTU

SINK = ("sink0", "sink1")          # in the switch namespace: lost packets go into sink0 and die at sink1
HOLD_RATE = "8kbit"                # a spike's rate: nothing but the one frame the full bucket lets through
FRAME = MTU + 14                   # the largest frame a veth of this MTU sends (Ethernet header included)
# The kernel's random u32 from classic BPF: an ancillary load at SKF_AD_OFF (-0x1000) + SKF_AD_RANDOM (56).
_LD_RANDOM = (1 << 32) - 0x1000 + 56


class ShapingError(RuntimeError):
    """A tc or ip command failed; the message has the command and tc's own words."""


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ShapingError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def tc(ns: str, *args: str) -> list[str]:
    """A tc command run in namespace `ns`."""
    return ["tc", "-n", ns, *args]


def tbf_burst_bytes(mbit: float) -> int:
    """The bucket of a tbf at `mbit` Mbit/s: 1 ms of traffic but at least one largest frame. So
    much passes at once, unshaped, after the link has been idle long enough to refill it (the
    replay's link model has the same bucket: parallel/replay/links.py)."""
    return max(FRAME, int(mbit * 1e6 / 8 * 0.001))


def tbf_args(mbit: float) -> list[str]:
    """tbf at `mbit` Mbit/s: its bucket (`tbf_burst_bytes`), a queue of 200 ms (32 to 256 MiB) so
    that shaping delays traffic and does not drop it."""
    bytes_per_s = mbit * 1e6 / 8
    burst = tbf_burst_bytes(mbit)
    limit = min(max(32 << 20, int(bytes_per_s * 0.2)), 256 << 20)
    return ["rate", f"{int(round(mbit * 1000))}kbit", "burst", str(burst), "limit", str(limit)]


def shape_commands(ns: str, dev: str, mbit: float | None, delay_ms: float) -> list[list[str]]:
    """The commands that give `dev`'s egress a rate (tbf) and a delay (netem under tbf).

    With a delay but no rate, tbf runs at a rate no link here reaches (100 Gbit/s), only to hold
    netem. Nothing at all for an unshaped, undelayed device.
    """
    if mbit is None and not delay_ms:
        return []
    cmds = [tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf", *tbf_args(mbit or 100_000))]
    if delay_ms:
        # netem's default limit (1000 packets) drops at high rates: allow a long queue.
        cmds.append(tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                       "delay", f"{delay_ms * 1000:.0f}us", "limit", "1000000"))
    return cmds


def loss_bytecode(loss_pct: float) -> str:
    """Classic BPF that matches a packet with probability loss_pct/100, in tc's `bytecode` form.

        ld  rand                 A = a uniform random u32 (the kernel's prandom)
        jgt #T, nomatch          A > T: not this one
        ret #-1                  match: the filter's action (the redirect into the sink) runs
        nomatch: ret #0

    P(A <= T) = (T + 1) / 2^32 with T = round(p * 2^32) - 1.
    """
    threshold = max(0, round(loss_pct / 100 * 2**32) - 1)
    program = [(0x20, 0, 0, _LD_RANDOM), (0x25, 1, 0, threshold), (0x06, 0, 0, 0xFFFFFFFF), (0x06, 0, 0, 0)]
    return f"{len(program)}," + ",".join(f"{code} {jt} {jf} {k}" for code, jt, jf, k in program)


def sink_commands(ns: str) -> list[list[str]]:
    """A veth pair in the switch namespace, both ends up: what is redirected into sink0 reaches
    sink1, addressed to another host's MAC, and the stack discards it (no forwarding here)."""
    a, b = SINK
    return [["ip", "-n", ns, "link", "add", a, "type", "veth", "peer", "name", b],
            ["ip", "-n", ns, "link", "set", a, "up"], ["ip", "-n", ns, "link", "set", b, "up"]]


def loss_commands(ns: str, dev: str, loss_pct: float) -> list[list[str]]:
    """Drop loss_pct% of what `dev` sends (the sink must exist); replaces an earlier loss filter."""
    return [
        tc(ns, "qdisc", "replace", "dev", dev, "clsact"),
        tc(ns, "filter", "replace", "dev", dev, "egress", "pref", "1", "handle", "1", "bpf", "bytecode",
           loss_bytecode(loss_pct), "action", "mirred", "egress", "redirect", "dev", SINK[0]),
    ]


def dropped_frames(ns: str, dev: str) -> int:
    """Frames the loss filter on `dev` has sent into the sink so far (0 without a filter)."""
    out = subprocess.run(tc(ns, "-s", "filter", "show", "dev", dev, "egress"), capture_output=True, text=True).stdout
    m = re.search(r"Sent \d+ bytes (\d+) pkt", out)
    return int(m.group(1)) if m else 0


def hold_commands(ns: str, dev: str) -> list[list[str]]:
    """Start a spike: the link's tbf at a near-zero rate (its queue is kept, and grows)."""
    return [tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
               "rate", HOLD_RATE, "burst", str(FRAME), "limit", str(256 << 20))]


def release_commands(ns: str, dev: str, mbit: float | None) -> list[list[str]]:
    """End a spike: the link's own rate again (100 Gbit/s for an unshaped link: the queue drains)."""
    return [tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf", *tbf_args(mbit or 100_000))]


def has_qdisc(ns: str, kind: str) -> bool:
    """Whether this kernel has qdisc `kind`: try it on the loopback of namespace `ns`, then remove it."""
    args = {"netem": ["delay", "1ms"], "tbf": tbf_args(1000)}[kind]
    proc = subprocess.run(tc(ns, "qdisc", "add", "dev", "lo", "root", "handle", "9:", kind, *args),
                          capture_output=True, text=True)
    if proc.returncode == 0:
        subprocess.run(tc(ns, "qdisc", "del", "dev", "lo", "root"), capture_output=True)
    return proc.returncode == 0
