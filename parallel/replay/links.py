"""Link models: how long a transfer takes on the links between two ranks, and which link it loads.

A model has two classes of link, each a bandwidth (bytes/s, one direction) and a latency (s per
step of an algorithm), and a placement of ranks on nodes:

    intra   between two ranks of one node   scope "rank": each rank's own link out (a GPU's
                                            NVLink, a rank's share of this machine's loopback);
                                            scope "node": one link per node shared by its ranks
                                            (an emulated node's shaped loopback)
    inter   between two nodes               scope "rank" (a NIC per GPU) or "node" (an emulated
                                            node's one veth to the switch, shared by its ranks)

Three sources, one constructor each:

    loopback(bytes_per_s, latency_s)      this machine, net=none: the rate, the per-step latency of
                                          a collective and the latency of one message that one
                                          rank reaches with one rank per core (probe.py), so the
                                          probe itself is not contended
    from_net(settings, loopback)          an emulated network's net.* (conf/net/): inter_mbit per
                                          node, intra_mbit per node (null: loopback), latency_ms;
                                          a shaped link has its tbf's token bucket
    from_cluster(...)                     a conf/cluster/ preset's NVLink and inter-node rates
                                          and latencies: the same figures the planner uses
                                          (launch/replay.py reads the preset)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from parallel.net.shaping import tbf_burst_bytes


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float
    scope: str = "rank"  # rank | node: who has a link of this class of their own
    # A token bucket in front of the rate (an emulated link's tbf, parallel/net/shaping.py): up to
    # `burst_bytes` pass at `line_bytes_per_s` (the unshaped rate) while the bucket holds tokens;
    # it refills at `bytes_per_s`. 0: no bucket, every byte at the rate.
    burst_bytes: float = 0.0
    line_bytes_per_s: float = 0.0
    # One point-to-point message's latency where it differs from a collective's per step (gloo on
    # loopback: a send or receive runs on the calling thread, a collective is handed to the group's
    # worker threads and back). None: the per-step latency.
    p2p_latency_s: float | None = None

    @property
    def message_latency_s(self) -> float:
        return self.latency_s if self.p2p_latency_s is None else self.p2p_latency_s


@dataclass(frozen=True)
class LinkModel:
    name: str
    intra: Link
    inter: Link | None = None
    procs_per_node: int | None = None  # None: every rank on one node
    placement: str = "block"  # block: rank r on node r // procs_per_node; cyclic: r % nodes
    nodes: int = 1
    source: str = ""  # where the figures came from, in words
    # How many collectives of one group the backend runs at once. gloo: 2, ProcessGroupGloo's worker
    # threads (Options.threads), each on its own gloo context, so its own connections, taking the
    # group's posted collectives in order; an async bucket's all-reduce overlaps the next one's.
    # NCCL: 1, a communicator's collectives run in order on its one stream.
    lanes: int = 2
    extra: dict = field(default_factory=dict)

    def node_of(self, rank: int) -> int:
        if not self.procs_per_node or self.nodes <= 1:
            return 0
        return rank % self.nodes if self.placement == "cyclic" else rank // self.procs_per_node

    def edge(self, src: int, dst: int) -> tuple[tuple, Link]:
        """The link a transfer from global rank `src` to `dst` loads, and its class's figures."""
        node = self.node_of(src)
        if node == self.node_of(dst) or self.inter is None:
            return (("intra", src) if self.intra.scope == "rank" else ("intra-node", node)), self.intra
        return (("inter", src) if self.inter.scope == "rank" else ("inter-node", node)), self.inter

    def link_class(self, link: tuple) -> Link:
        return self.intra if link[0].startswith("intra") else self.inter

    def bandwidth(self, link: tuple) -> float:
        return self.link_class(link).bytes_per_s

    def bucket(self, link: tuple) -> tuple[float, float] | None:
        """(burst bytes, line bytes/s) of the link's token bucket, or None where it has none."""
        figures = self.link_class(link)
        return (figures.burst_bytes, figures.line_bytes_per_s) if figures.burst_bytes > 0 else None

    def as_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "nodes": self.nodes, "procs_per_node": self.procs_per_node,
                "placement": self.placement, "lanes": self.lanes, "intra": asdict(self.intra),
                "inter": asdict(self.inter) if self.inter else None, **self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> LinkModel:
        known = {"name", "source", "nodes", "procs_per_node", "placement", "lanes", "intra", "inter"}
        return cls(d["name"], Link(**d["intra"]), Link(**d["inter"]) if d.get("inter") else None,
                   d.get("procs_per_node"), d.get("placement", "block"), d.get("nodes", 1), d.get("source", ""),
                   int(d.get("lanes", 2)), {k: v for k, v in d.items() if k not in known})


def loopback(bytes_per_s: float, latency_s: float, source: str = "", p2p_latency_s: float | None = None) -> LinkModel:
    """This machine's loopback: every rank on one node, each with its own share."""
    return LinkModel("loopback", Link(bytes_per_s, latency_s, "rank", p2p_latency_s=p2p_latency_s), source=source)


def from_net(settings: dict, loop: LinkModel) -> LinkModel:
    """An emulated network (net.* as launch.run sets it up); unshaped classes run at loopback's rate.
    A shaped class gets its tbf's bucket (the same size launch.run gives tc), passing at loopback's
    rate while it holds tokens."""
    nodes = int(settings.get("nodes") or 1)
    latency = float(settings.get("latency_ms") or 0) * 1e-3
    intra_mbit, inter_mbit = settings.get("intra_mbit"), settings.get("inter_mbit")
    own = loop.intra  # loopback: what an unshaped link carries, and a shaped one's bucket passes at

    def shaped(mbit: float, added_s: float) -> Link:
        return Link(mbit * 1e6 / 8, own.latency_s + added_s, "node", float(tbf_burst_bytes(mbit)), own.bytes_per_s,
                    own.message_latency_s + added_s)

    intra = shaped(intra_mbit, 0.0) if intra_mbit else own
    if nodes <= 1:
        inter = None
    elif inter_mbit:
        inter = shaped(inter_mbit, latency)
    else:  # unshaped between nodes: loopback's rate, a link per rank, plus the added latency
        inter = Link(own.bytes_per_s, own.latency_s + latency, "rank", p2p_latency_s=own.message_latency_s + latency)
    return LinkModel(f"net={settings.get('name', '?')}", intra, inter, int(settings.get("procs_per_node") or 0) or None,
                     settings.get("placement", "block"), nodes, lanes=loop.lanes,
                     source=f"net.* settings (intra {intra_mbit} Mbit/s, inter {inter_mbit} Mbit/s per node, "
                            f"latency {settings.get('latency_ms', 0)} ms); unshaped classes and per-step latency: "
                            f"{loop.source}")


def from_cluster(name: str, gpus_per_node: int, intra_bytes_per_s: float, inter_bytes_per_s: float,
                 intra_latency_s: float, inter_latency_s: float, world: int, comm_efficiency: float = 1.0) -> LinkModel:
    """A cluster's links per GPU, one direction (the planner's Cluster figures, comm efficiency applied)."""
    nodes = max(1, -(-world // gpus_per_node))
    return LinkModel(f"cluster={name}", Link(intra_bytes_per_s * comm_efficiency, intra_latency_s, "rank"),
                     Link(inter_bytes_per_s * comm_efficiency, inter_latency_s, "rank") if nodes > 1 else None,
                     gpus_per_node, "block", nodes, lanes=1,  # NCCL: one stream per communicator
                     source=f"conf/cluster/{name}.yaml: NVLink {intra_bytes_per_s / 1e9:g} GB/s, inter-node "
                            f"{inter_bytes_per_s / 1e9:g} GB/s per GPU one way, x comm_efficiency {comm_efficiency:g}")
