"""Put a rank on the node its placement names: `python -m parallel.net.placement <module> <args>`.

torchrun numbers ranks node by node (node k's agent starts ranks k*P .. k*P+P-1), which is
`net.placement=block`. For `cyclic` (rank r on node r mod nodes, topology.NetSpec.node_of_rank)
launch.run has each agent start its workers through this module: a worker whose rank belongs to
another node moves into that node's namespace (`ip netns exec`, which replaces this process, so
its agent still watches the same pid) and runs `<module>` there; the others run it where they are.

Only where a process runs changes: the rendezvous and every store stay on node 0's address, which
every namespace reaches through the switch, and gloo binds the node's own `net0` (GLOO_SOCKET_IFNAME)
wherever the rank lands, so its traffic crosses the links its placement implies.

launch.run passes, besides the probe's variables (probe.py):
    PARALLEL_NET_NAMESPACES   the node namespaces, node 0 first (JSON list)
"""

from __future__ import annotations

import json
import os
import sys

from parallel.net.probe import ENV_NODE, ENV_SETTINGS
from parallel.net.topology import NetSpec

ENV_NAMESPACES = "PARALLEL_NET_NAMESPACES"


def command(rank: int, spec: NetSpec, here: int, namespaces: list[str], module: str, args: list[str]) -> list[str]:
    """The command that runs `module` for `rank` on its node, from node `here`."""
    cmd = [sys.executable, "-u", "-m", module, *args]
    node = spec.node_of_rank(rank)
    return cmd if node == here else ["ip", "netns", "exec", namespaces[node], *cmd]


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m parallel.net.placement MODULE [ARGS...] (under launch.run's torchrun agents)")
    spec = NetSpec.from_config(json.loads(os.environ[ENV_SETTINGS]))
    rank, here = int(os.environ["RANK"]), int(os.environ[ENV_NODE])
    cmd = command(rank, spec, here, json.loads(os.environ[ENV_NAMESPACES]), argv[0], argv[1:])
    os.execvpe(cmd[0], cmd, {**os.environ, ENV_NODE: str(spec.node_of_rank(rank))})


if __name__ == "__main__":
    main(sys.argv[1:])
