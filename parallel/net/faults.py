"""Link faults, applied by launch.run while the job runs, and the verdict when a job fails.

`link_fault` (conf/run.yaml) picks one fault on one node's link, applied once rank 0 has logged
step `at_step` in metrics.jsonl:

    down    the switch port of the node's link is set down (a pulled cable): no frame passes,
            nothing is reset, so the ranks' next collective waits until parallel.timeout_s
    loss    the node's download drops loss_pct% of frames from then on (shaping.loss_commands)
    spike   both directions of the node's link hold their traffic for spike_ms, then release it
            (shaping.hold_commands): a latency spike of spike_ms for whatever was sent meanwhile

After a failed job, `unreachable_nodes` says which nodes can no longer be reached, from the links'
state and a TCP probe between the namespaces.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from parallel.net import shaping
from parallel.net.netns import EmulatedNetwork
from parallel.net.topology import NODE_IF, NetConfigError

KINDS = ("down", "loss", "spike")


@dataclass(frozen=True)
class LinkFault:
    kind: str
    node: int
    at_step: int
    loss_pct: float
    spike_ms: float

    @classmethod
    def from_config(cls, cfg, nodes: int, steps: int) -> LinkFault | None:
        """From `link_fault` (a DictConfig or dict); None when kind is null."""
        get = cfg.get if hasattr(cfg, "get") else cfg.__getitem__
        kind = get("kind")
        if kind is None:
            return None
        if kind not in KINDS:
            raise NetConfigError(f"link_fault.kind={kind!r}: choose one of {', '.join(KINDS)}, or null (no fault)")
        if nodes < 2:
            raise NetConfigError(f"link_fault.kind={kind} needs an emulated network of at least 2 nodes "
                                 f"(net.nodes={nodes})")
        node, at_step = get("node"), get("at_step")
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
            raise NetConfigError(f"link_fault.node={node!r} must be a node of the network, 0..{nodes - 1}")
        if isinstance(at_step, bool) or not isinstance(at_step, int) or not 0 <= at_step < steps:
            raise NetConfigError(f"link_fault.at_step={at_step!r} must be a step the run reaches, 0..{steps - 1}")
        loss_pct, spike_ms = get("loss_pct"), get("spike_ms")
        if kind == "loss" and (not isinstance(loss_pct, (int, float)) or not 0 < loss_pct < 100):
            raise NetConfigError(f"link_fault.loss_pct={loss_pct!r} must be a percentage between 0 and 100 (exclusive)")
        if kind == "spike" and (not isinstance(spike_ms, (int, float)) or spike_ms <= 0):
            raise NetConfigError(f"link_fault.spike_ms={spike_ms!r} must be a positive number of milliseconds")
        return cls(kind, node, at_step, float(loss_pct or 0), float(spike_ms or 0))


def logged_step(metrics: Path) -> int:
    """The last step rank 0 has written to metrics.jsonl (-1: none yet)."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line still being written
    return -1


class AtStep(threading.Thread):
    """A thread that waits until rank 0 has logged step `at_step` in `metrics`, then calls `fire()`
    once (unless stopped first: the job ended before that step)."""

    def __init__(self, at_step: int, metrics: Path):
        super().__init__(daemon=True)
        self.at_step, self.metrics = at_step, metrics
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set() and logged_step(self.metrics) < self.at_step:
            time.sleep(0.02)
        if not self._stop.is_set():
            self.fire()

    def fire(self) -> None:
        raise NotImplementedError


class FaultInjector(AtStep):
    """Waits for step `fault.at_step` in `metrics`, applies the fault, and records when."""

    def __init__(self, fault: LinkFault, net: EmulatedNetwork, metrics: Path):
        super().__init__(fault.at_step, metrics)
        self.fault, self.net = fault, net
        self.applied_at: float | None = None  # time.monotonic() when the fault took effect
        self.error: str | None = None

    def fire(self) -> None:
        try:
            self._apply()
        except shaping.ShapingError as e:
            self.error = str(e)

    def _apply(self) -> None:
        f, names, spec = self.fault, self.net.names, self.net.spec
        sw, node, port = names.switch, names.node(f.node), names.port(f.node)
        if f.kind == "down":
            shaping.run(["ip", "-n", sw, "link", "set", port, "down"])
        elif f.kind == "loss":
            if not spec.loss_pct:  # the sink exists only when the network was built lossy
                for cmd in shaping.sink_commands(sw):
                    shaping.run(cmd)
            for cmd in shaping.loss_commands(sw, port, f.loss_pct):
                shaping.run(cmd)
        else:
            for cmd in shaping.hold_commands(sw, port) + shaping.hold_commands(node, NODE_IF):
                shaping.run(cmd)
            self.applied_at = time.monotonic()
            time.sleep(f.spike_ms / 1000)
            release = shaping.release_commands(sw, port, spec.inter_mbit)
            for cmd in release + shaping.release_commands(node, NODE_IF, spec.inter_mbit):
                shaping.run(cmd)
        self.applied_at = self.applied_at or time.monotonic()
        print(f"link_fault: {f.kind} on node {f.node}'s link after step {f.at_step}", file=sys.stderr, flush=True)

    def describe(self) -> str:
        f = self.fault
        what = {"down": "went down", "loss": f"started losing {f.loss_pct:g}% of frames",
                "spike": f"held its traffic for {f.spike_ms:g} ms"}[f.kind]
        return f"node {f.node}'s link {what} after step {f.at_step}"


# A TCP connection attempt from one namespace to the others' addresses: a refused connection
# (nothing listens on the discard port) means the address answers; a timeout means it does not.
_PROBE = """
import socket, sys, concurrent.futures as cf
def answers(addr):
    s = socket.socket(); s.settimeout(float(sys.argv[1]))
    try:
        s.connect((addr, 9)); return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()
with cf.ThreadPoolExecutor(len(sys.argv) - 2) as pool:
    print(" ".join("1" if ok else "0" for ok in pool.map(answers, sys.argv[2:])))
"""


def unreachable_nodes(net: EmulatedNetwork, timeout_s: float = 1.0) -> dict[int, str]:
    """Nodes that no other node can reach, each with why (its link's state), e.g. {1: "its link is down"}.

    Every node probes every other at once (one process per namespace). With two nodes a broken
    link cuts both off from each other; a switch port that is down then says whose link it is.
    """
    n = net.spec.nodes
    addrs = [net.names.address(k) for k in range(n)]
    procs = [subprocess.Popen(net.node_command(k, [sys.executable, "-c", _PROBE, str(timeout_s),
                                                   *[a for j, a in enumerate(addrs) if j != k]]),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for k in range(n)]
    reach = {}
    for k, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=timeout_s + 30)
        others = [j for j in range(n) if j != k]
        reach.update({(k, j): flag == "1" for j, flag in zip(others, out.split())})
    cut_off = [j for j in range(n) if n > 1 and not any(reach.get((k, j), False) for k in range(n) if k != j)]
    down = {j for j in range(n) if not _port_up(net, j)}
    if down & set(cut_off):
        cut_off = [j for j in cut_off if j in down]
    return {j: "its link is down" if j in down else "its link is up but passes nothing" for j in cut_off}


def _port_up(net: EmulatedNetwork, k: int) -> bool:
    out = subprocess.run(["ip", "-n", net.names.switch, "-o", "link", "show", net.names.port(k)],
                         capture_output=True, text=True).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "UP" in flags
