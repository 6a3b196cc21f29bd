"""What a training process records on an emulated network: its node's byte counters around the
timed steps, and what rank 0 makes of every rank's records (the summary's `net` block).

The training loop sees three calls (parallel/train.py):

    wire = WireProbe.from_environ(ctx, first_timed_step)     # inert unless launch.run set the network up
    for step in wire.steps(range(start, steps)): ...         # read before the first timed step, after the last
    report["net"] = wire.report();  summary["net"] = wire.summary(reports, timed_from)

A reading is a barrier, the read, and a barrier: the first barrier makes sure every byte of the
steps before it was received (so counted by its sender's interface), the second that no rank of
the node starts sending the next step's bytes before the node's reading is taken. The barriers
are tooling calls outside every step; their few bytes are inside the window, and so are the
tooling calls of the timed steps (the loss for the log, the finite check), which the prediction
includes as well.

launch.run passes the network to the processes in the environment:
    PARALLEL_NET          the net settings (JSON, topology.NetSpec's fields)
    PARALLEL_NET_IFNAME   the node's link to the switch (`net0`); absent for net=none, where this
                          machine's interfaces carry everything else too and are not read
    PARALLEL_NET_NODE     which emulated node (namespace) the process runs in
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

from parallel.net import counters, predict

ENV_SETTINGS = "PARALLEL_NET"
ENV_IFNAME = "PARALLEL_NET_IFNAME"
ENV_NODE = "PARALLEL_NET_NODE"
TAG = "tooling/net_counters"


class WireProbe:
    """One training process's view of the emulated network: its node, its groups, its node's counters."""

    def __init__(self, world, rank: int, node: int, groups: dict[str, list[int]], first_timed_step: int,
                 settings: dict | None, ifname: str | None):
        self.world = world
        self.rank = rank
        self.node = node
        self.groups = groups
        self.first_timed_step = first_timed_step
        self.settings = settings
        self.ifname = ifname
        self._start: dict | None = None
        self._end: dict | None = None
        self.timed_steps = 0

    @classmethod
    def from_environ(cls, ctx, first_timed_step: int) -> WireProbe:
        """From the run's DistContext; inert (no barriers, no block in the summary) without launch.run."""
        raw = os.environ.get(ENV_SETTINGS)
        groups = {name: list(c.global_ranks) for name, c in ctx.comms.items()}
        node = int(os.environ.get(ENV_NODE, os.environ.get("GROUP_RANK", 0)))
        return cls(ctx.comm("world"), ctx.rank, node, groups, first_timed_step,
                   json.loads(raw) if raw else None, os.environ.get(ENV_IFNAME))

    @property
    def active(self) -> bool:
        return self.settings is not None

    @property
    def reads_counters(self) -> bool:
        return self.active and self.ifname is not None

    def _read(self) -> dict:
        if self.world is not None:
            self.world.barrier(tag=TAG)
        reading = {name: counters.read(name) for name in (self.ifname, "lo")}
        reading["tcp"] = counters.tcp_retransmits()
        if self.world is not None:
            self.world.barrier(tag=TAG)
        return reading

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """The training loop's steps, with a reading before the first timed one and after the last."""
        for step in steps:
            if step >= self.first_timed_step:
                if self._start is None and self.reads_counters:
                    self._start = self._read()
                self.timed_steps += 1
            yield step
        if self._start is not None:
            self._end = self._read()

    def report(self) -> dict | None:
        """This rank's part: its node, its groups, and its node's counters over the timed steps."""
        if not self.active:
            return None
        wire = None
        if self._start is not None and self._end is not None:
            wire = {"inter": counters.delta(self._start[self.ifname], self._end[self.ifname]),
                    "intra": counters.delta(self._start["lo"], self._end["lo"]),
                    "tcp_retransmits": {k: self._end["tcp"][k] - self._start["tcp"][k] for k in self._end["tcp"]}}
        mtu = {"inter": counters.mtu(self.ifname) if self.ifname else None, "intra": counters.mtu("lo")}
        return {"node": self.node, "groups": self.groups, "wire": wire, "timed_steps": self.timed_steps, "mtu": mtu}

    def summary(self, rank_reports: list[dict], timed_from: int) -> dict | None:
        """Rank 0: the `net` block from every rank's report (its "net" part and its "traffic")."""
        if not self.active:
            return None
        nets = {r["rank"]: r["net"] for r in rank_reports}
        node_of = {rank: net["node"] for rank, net in nets.items()}
        mtu = nets[0]["mtu"]
        mtu = {"inter": mtu["inter"] or mtu["intra"], "intra": mtu["intra"]}  # net=none: one node, no link
        logged = predict.per_step({r["rank"]: r["traffic"][timed_from:] for r in rank_reports},
                                  {rank: net["groups"] for rank, net in nets.items()}, node_of, mtu)
        wire = _wire_per_step(nets)
        block = {
            "settings": self.settings,
            "nodes_of_ranks": [node_of[r] for r in sorted(node_of)],
            "timed_steps": nets[0]["timed_steps"],
            "mtu": mtu,
        }
        for kind in ("inter", "intra"):
            block[f"wire_{kind}_bytes_per_step"] = wire[kind] if wire else None
            block[f"logged_{kind}_bytes_per_step"] = logged[kind]["wire"]
            block[f"logged_{kind}_payload_bytes_per_step"] = logged[kind]["payload"]
        block["by_link_class"] = {
            kind: {"mbit": self.settings.get(f"{kind}_mbit"),
                   "wire_bytes_per_step": block[f"wire_{kind}_bytes_per_step"],
                   "logged_bytes_per_step": logged[kind]["wire"],
                   "logged_payload_bytes_per_step": logged[kind]["payload"],
                   "wire_over_logged": _ratio(block[f"wire_{kind}_bytes_per_step"], logged[kind]["wire"])}
            for kind in ("inter", "intra")
        }
        # The raw counters over the timed steps, per node (its lowest rank's reading), and the TCP
        # segments sent again (loss, or a timeout): bytes on the wire that no log predicts.
        per_node = _per_node(nets)
        block["wire_by_node"] = {str(node): net["wire"] for node, net in per_node.items()}
        block["tcp_retransmitted_segments"] = (sum(n["wire"]["tcp_retransmits"]["segments"] for n in per_node.values())
                                               if wire else None)
        return block


def _per_node(nets: dict[int, dict]) -> dict[int, dict]:
    """One report per node: its lowest rank's (every rank of a node reads the same counters)."""
    per_node = {}
    for rank in sorted(nets):
        per_node.setdefault(nets[rank]["node"], nets[rank])
    return dict(sorted(per_node.items()))


def _wire_per_step(nets: dict[int, dict]) -> dict[str, float] | None:
    """Sum over nodes of the bytes each node's interfaces sent, per timed step: every frame is
    counted once, at its sender."""
    per_node = _per_node(nets)
    steps = nets[0]["timed_steps"]
    if not steps or any(net["wire"] is None for net in per_node.values()):
        return None
    return {kind: sum(n["wire"][kind]["tx_bytes"] for n in per_node.values()) / steps for kind in ("inter", "intra")}


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None or not b else a / b


