"""The kernel's byte counters of a network interface, as the process's own namespace sees them.

/sys/class/net/<ifname>/statistics/{tx,rx}_{bytes,packets} count every frame the device sent or
received, Ethernet, IP and TCP headers included, acknowledgements and retransmissions included.
Inside an emulated node (`ip netns exec` mounts a /sys of that namespace) `net0` is the node's link
to the switch and `lo` its intra-node link; the ranks of a node share both, so one reading per node
is the node's traffic.
"""

from __future__ import annotations

from pathlib import Path

FIELDS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")


def read(ifname: str, root: Path = Path("/sys/class/net")) -> dict[str, int]:
    stats = root / ifname / "statistics"
    return {f: int((stats / f).read_text()) for f in FIELDS}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {f: after[f] - before[f] for f in FIELDS}


def mtu(ifname: str, root: Path = Path("/sys/class/net")) -> int:
    return int((root / ifname / "mtu").read_text())


def tcp_retransmits(proc: Path = Path("/proc/net")) -> dict[str, int]:
    """The namespace's TCP segments sent again so far (/proc/net/snmp's Tcp RetransSegs) and, of
    them, tail loss probes (/proc/net/netstat's TcpExt TCPLossProbes): bytes the log cannot predict."""
    def table(path: Path, prefix: str) -> dict[str, int]:
        rows = [line.split() for line in path.read_text().splitlines() if line.startswith(prefix)]
        return dict(zip(rows[0][1:], map(int, rows[1][1:])))

    return {"segments": table(proc / "snmp", "Tcp:")["RetransSegs"],
            "loss_probes": table(proc / "netstat", "TcpExt:").get("TCPLossProbes", 0)}
