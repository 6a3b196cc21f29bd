"""The torchrun agents of a job on emulated nodes: restarts, and an agent lost on purpose.

launch.run starts one torchrun agent per node (launch/run.py `agent_command`). Two layers restart
a failed job, as on a real cluster:

  - each agent restarts its own workers (`agent.max_restarts`, torchrun's `--max-restarts`): when
    one of its workers fails, it stops the others and joins the next round of the c10d
    rendezvous; the other nodes' agents join it too (their workers fail when a peer's connections
    close, or they see a node waiting for the next round), and the new round starts every worker
    again, each node's ranks where they were (the rendezvous orders nodes by address);
  - an agent that dies itself (SIGKILL, `agent_fault`) can restart nothing. Its workers run on,
    in sessions of their own, with no one to report their exit; launch.run, the agents'
    supervisor, ends them (the node is lost to the job, as when a machine goes down) and starts a
    fresh agent on that node, at most `agent.max_restarts` times in the job. The fresh agent joins
    the surviving agents' next round once the rendezvous has dropped the dead one: a participant
    whose keep-alive heartbeat is older than keep_alive_interval x keep_alive_max_attempt
    (`RDZV_KEEP_ALIVE`) is removed, and a round of --nnodes participants completes at once.

Node 0's agent is never replaced: it hosts the rendezvous' store (is_host=1), which holds the
round's state and which every worker's process group starts from; when it dies the others cannot
even tell who is left. A cluster survives that with a store outside the agents (etcd, or a
dedicated c10d host); launch.run does not emulate one, and refuses `agent_fault.node=0`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parallel.net.faults import AtStep
from parallel.net.netns import EmulatedNetwork, pids_in
from parallel.net.topology import NetConfigError

ENV_AGENT = "PARALLEL_NET_AGENT"  # the node whose agent started a process (placement may move it elsewhere)

# torchrun's defaults (5 s x 3) drop a dead agent 10-15 s after its last heartbeat; with restarts on,
# 1 s x 5 drops it within about 5 s, long enough that an agent merely slowed by a busy machine
# (its heartbeat is a timer thread in an otherwise idle process) is not dropped.
RDZV_KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=5"

# By default the agent that is rendezvous rank 0 also hosts its workers' store, and every agent
# learns that store's address once, in its first round. A fresh agent's first round is the job's
# second: it waits for an address the others published a round earlier, and the round never
# starts. With this set, rank 0's agent publishes a store address (rank 0's worker hosts it) in
# every round, so a newcomer finds it.
FRESH_AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def max_restarts_from_config(agent) -> int:
    value = agent.get("max_restarts") if hasattr(agent, "get") else agent["max_restarts"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise NetConfigError(f"agent.max_restarts={value!r} must be an integer >= 0 (torchrun's --max-restarts)")
    return value


@dataclass(frozen=True)
class AgentFault:
    """Node `node`'s torchrun agent SIGKILLed once rank 0 has logged step `at_step`."""

    node: int
    at_step: int

    @classmethod
    def from_config(cls, cfg, nodes: int, steps: int) -> AgentFault | None:
        """From `agent_fault` (a DictConfig or dict); None when node is null."""
        get = cfg.get if hasattr(cfg, "get") else cfg.__getitem__
        node, at_step = get("node"), get("at_step")
        if node is None:
            return None
        if nodes < 2:
            raise NetConfigError(f"agent_fault.node={node!r} needs an emulated network of at least 2 nodes "
                                 f"(net.nodes={nodes}): e.g. net=cluster")
        if isinstance(node, bool) or not isinstance(node, int) or not 1 <= node < nodes:
            raise NetConfigError(f"agent_fault.node={node!r} must be a node 1..{nodes - 1}: node 0's agent hosts "
                                 "the rendezvous store, and the job cannot outlive it")
        if isinstance(at_step, bool) or not isinstance(at_step, int) or not 0 <= at_step < steps:
            raise NetConfigError(f"agent_fault.at_step={at_step!r} must be a step the run reaches, 0..{steps - 1}")
        return cls(node, at_step)


class AgentKiller(AtStep):
    """Waits for step `fault.at_step` in `metrics`, then SIGKILLs node `fault.node`'s current agent."""

    def __init__(self, fault: AgentFault, agents: list[subprocess.Popen], metrics: Path):
        super().__init__(fault.at_step, metrics)
        self.fault, self.agents = fault, agents

    def fire(self) -> None:
        agent = self.agents[self.fault.node]
        try:
            os.kill(agent.pid, signal.SIGKILL)  # `ip netns exec` execs the agent: this pid is torchrun's
        except ProcessLookupError:
            return
        print(f"agent_fault: node {self.fault.node}'s torchrun agent (pid {agent.pid}) SIGKILLed after step "
              f"{self.fault.at_step}", file=sys.stderr, flush=True)


def node_processes(net: EmulatedNetwork, node: int) -> list[int]:
    """Every process of node `node`'s agent (its workers, wherever net.placement put them): they
    carry the agent's node number (ENV_AGENT, which launch.run sets and, unlike ENV_NODE, nothing
    rewrites) in their environment."""
    marker = f"{ENV_AGENT}={node}".encode()
    found = []
    for pid in (p for ns in net.names.namespaces for p in pids_in(ns)):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            found.append(pid)
    return found


def end_node(net: EmulatedNetwork, node: int) -> None:
    """SIGKILL what is left of node `node`'s job after its agent died, and wait until it is gone."""
    pids = node_processes(net, node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while node_processes(net, node) and time.monotonic() < deadline:
        time.sleep(0.05)


class AgentReplacer:
    """`replace(k, code)` for launch.run's wait loop: a fresh agent in place of node k's dead one."""

    def __init__(self, net: EmulatedNetwork, start: Callable[[int], subprocess.Popen], max_restarts: int):
        self.net, self.start, self.left = net, start, max_restarts

    def __call__(self, node: int, code: int) -> subprocess.Popen | None:
        """None where the death ends the job: node 0 (the rendezvous host), an agent that exited
        on its own (its workers' restarts are spent), or no replacement left."""
        if node == 0 or code >= 0 or self.left == 0:
            return None
        self.left -= 1
        print(f"launch.run: node {node}'s agent died ({signal.Signals(-code).name}); its workers are ended and a "
              f"fresh agent starts there ({self.left} replacement(s) left)", file=sys.stderr, flush=True)
        end_node(self.net, node)
        return self.start(node)
