"""The emulated network's settings, and the names and addresses of everything it creates.

One job on `nodes` emulated nodes, `procs_per_node` ranks each:

    namespace pnet<pid>-n<k>   node k: interface `net0` (198.18.0.<100+k>/24) and its own loopback
    namespace pnet<pid>-sw     the switch: bridge `br0` with one port `n<k>` per node

Each node's `net0` is one end of a veth pair whose other end, `n<k>`, is a port of the bridge in
the switch namespace. Nothing is created in the host's own namespace, and the addresses come from
198.18.0.0/15 (RFC 2544's benchmarking range, never routed on the internet) with no default route:
traffic can go from one emulated node to another, and nowhere else.

Which node each rank runs on (`placement`): `block` (torchrun's own numbering: node k holds ranks
k*P .. k*P+P-1, so consecutive ranks share a node and the innermost mesh dimension, tp, stays
inside one) or `cyclic` (rank r on node r mod nodes: consecutive ranks on different nodes, so tp
groups span nodes and the outer dimensions, dp, stay inside; parallel/net/placement.py moves each
rank into its node's namespace). Slurm's `--distribution=block|cyclic` names the same two.

`pid` is the launcher's process id: a namespace whose launcher is gone is a leftover of a crashed
run, found and removed at the next start (netns.remove_leftovers).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass

NAME_PREFIX = "pnet"
NAME_PATTERN = re.compile(rf"^{NAME_PREFIX}(\d+)-(sw|n\d+)$")
SUBNET = "198.18.0"          # node k is 198.18.0.<100+k>/24, inside 198.18.0.0/15
PREFIX_LEN = 24
NODE_IF = "net0"             # a node's link to the switch, inside its namespace
BRIDGE = "br0"
# torchrun's c10d rendezvous numbers the nodes in the string order of their addresses: three-digit
# last bytes (100..199) keep that order equal to k, so node k holds ranks k*P .. k*P+P-1.
FIRST_HOST = 100
MAX_NODES = 100
# Large frames make the Ethernet, IP and TCP headers (66 bytes a frame) negligible next to the
# payload: 0.1% at 65535 bytes, against 4.5% at the usual 1500 (docs/network.md).
MTU = 65535
PLACEMENTS = ("block", "cyclic")


class NetConfigError(ValueError):
    """A network setting that cannot run; the message names it and the fix."""


def _number(name: str, value, *, positive: bool, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise NetConfigError(f"{name}={value!r} must be a number")
    if positive and value <= 0:
        raise NetConfigError(f"{name}={value!r} must be a positive number of Mbit/s (or null: unshaped)")
    if not positive and value < 0:
        raise NetConfigError(f"{name}={value!r} must be >= 0")
    return float(value)


def _count(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
        raise NetConfigError(f"{name}={value!r} must be {bound}")
    return value


def _placement(value) -> str:
    if value not in PLACEMENTS:
        raise NetConfigError(f"net.placement={value!r}: choose block (node k holds consecutive ranks) or cyclic "
                             "(rank r on node r mod net.nodes)")
    return value


@dataclass(frozen=True)
class NetSpec:
    """The `net` config group, validated. `name` none: plain torchrun on this machine, no namespaces."""

    name: str
    nodes: int
    procs_per_node: int
    inter_mbit: float | None      # each node's link to the switch, each direction; None: unshaped
    intra_mbit: float | None      # each node's loopback (its ranks' shared intra-node link); None: unshaped
    latency_ms: float             # one-way node-to-node delay (half on each end of the path)
    loss_pct: float               # node-to-node packet loss, applied once on the path
    timeout_s: float              # the whole job is stopped after this long
    placement: str = "block"      # block: rank r on node r // procs_per_node; cyclic: on node r % nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def node_of_rank(self, rank: int) -> int:
        """The node that runs global rank `rank` under this placement."""
        return rank % self.nodes if self.placement == "cyclic" else rank // self.procs_per_node

    @property
    def emulated(self) -> bool:
        return self.name != "none"

    @classmethod
    def from_config(cls, net) -> NetSpec:
        """From the `net` DictConfig (or a dict); one NetConfigError naming the first bad value."""
        get = net.get if hasattr(net, "get") else net.__getitem__
        name = get("name")
        if not isinstance(name, str) or not name:
            raise NetConfigError(f"net.name={name!r} must be a preset name (conf/net/)")
        spec = cls(
            name=name,
            nodes=_count("net.nodes", get("nodes"), 1, MAX_NODES),
            procs_per_node=_count("net.procs_per_node", get("procs_per_node"), 1),
            inter_mbit=_number("net.inter_mbit", get("inter_mbit"), positive=True, allow_none=True),
            intra_mbit=_number("net.intra_mbit", get("intra_mbit"), positive=True, allow_none=True),
            latency_ms=_number("net.latency_ms", get("latency_ms"), positive=False),
            loss_pct=_number("net.loss_pct", get("loss_pct"), positive=False),
            timeout_s=_number("net.timeout_s", get("timeout_s"), positive=False),
            placement=_placement(get("placement") if "placement" in net else "block"),
        )
        if spec.loss_pct >= 100:
            raise NetConfigError(f"net.loss_pct={spec.loss_pct:g} must be below 100 (100 is a link that is down)")
        if spec.timeout_s <= 0:
            raise NetConfigError(f"net.timeout_s={spec.timeout_s:g} must be a positive number of seconds")
        shaped = spec.inter_mbit or spec.intra_mbit or spec.latency_ms or spec.loss_pct
        if not spec.emulated and (spec.nodes != 1 or shaped):
            raise NetConfigError(
                f"net=none runs on this machine's own network, one node, unshaped: it cannot have "
                f"net.nodes={spec.nodes}, rates, latency or loss; choose an emulated preset (e.g. net=ethernet_1g) "
                "for those"
            )
        return spec

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Names:
    """Every name and address one emulated network uses, from the launcher's pid."""

    owner_pid: int
    nodes: int

    @classmethod
    def for_this_process(cls, nodes: int) -> Names:
        return cls(os.getpid(), nodes)

    @property
    def switch(self) -> str:
        return f"{NAME_PREFIX}{self.owner_pid}-sw"

    def node(self, k: int) -> str:
        return f"{NAME_PREFIX}{self.owner_pid}-n{k}"

    @staticmethod
    def port(k: int) -> str:
        """Node k's link as seen from the switch (a bridge port)."""
        return f"n{k}"

    @staticmethod
    def address(k: int) -> str:
        return f"{SUBNET}.{FIRST_HOST + k}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch] + [self.node(k) for k in range(self.nodes)]


def owner_of(namespace: str) -> int | None:
    """The launcher pid a namespace name carries, or None for a namespace that is not ours."""
    m = NAME_PATTERN.match(namespace)
    return int(m.group(1)) if m else None
