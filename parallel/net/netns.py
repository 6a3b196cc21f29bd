"""Create the emulated network and take it down again, whatever happens in between.

    with EmulatedNetwork(spec) as net:       # namespaces, bridge, veths, addresses, shaping
        net.popen(k, [...])                  # a process inside node k's namespace
    # here every process in the namespaces is stopped and every namespace deleted

Deleting a namespace deletes the interfaces in it, and a veth pair goes with either end, so
deleting our namespaces removes everything we made; nothing is ever created in the host's own
namespace. Three lines of defence keep nothing behind:

  1. `__exit__` (a normal end, an exception, Ctrl-C or SIGTERM turned into an exception by the
     launcher) stops the processes in the namespaces and deletes them;
  2. a reaper process in its own session waits for the launcher to die (the end of a pipe only
     the launcher holds) and then does the same: a SIGKILLed launcher leaves nothing either;
  3. at every start, namespaces named after a launcher that no longer runs are removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from parallel.net import shaping
from parallel.net.topology import BRIDGE, MTU, NODE_IF, PREFIX_LEN, Names, NetSpec, owner_of


class NetSetupError(RuntimeError):
    """The network could not be built (a command failed); nothing is left behind."""


def _ip(*args: str) -> str:
    try:
        return shaping.run(["ip", *args])
    except shaping.ShapingError as e:
        raise NetSetupError(str(e)) from None


def list_namespaces() -> list[str]:
    """Every named network namespace (`ip netns list` prints "name (id: N)" or "name")."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def our_namespaces() -> list[str]:
    return [ns for ns in list_namespaces() if owner_of(ns) is not None]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def pids_in(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def stop_processes(namespaces: list[str], grace_s: float = 5.0) -> None:
    """SIGTERM every process inside `namespaces`, SIGKILL what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = [p for ns in namespaces for p in pids_in(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def delete_namespaces(namespaces: list[str], grace_s: float = 5.0) -> None:
    """Stop their processes, then delete them (and with them every interface inside)."""
    existing = set(list_namespaces())
    namespaces = [ns for ns in namespaces if ns in existing]
    stop_processes(namespaces, grace_s)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of launchers that are no longer running (a crashed or killed run)."""
    stale = [ns for ns in our_namespaces() if not _alive(owner_of(ns))]
    delete_namespaces(stale, grace_s=1.0)
    return stale


def _start_reaper(names: Names) -> int:
    """A process in its own session that deletes `names`' namespaces once this process is gone.

    It blocks reading a pipe whose write end only this process holds; the kernel closes it when
    this process ends, however it ends (SIGKILL included). Returns the write end's descriptor.
    """
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    subprocess.Popen([sys.executable, "-m", "parallel.net.netns", "--reap", str(read_end), *names.namespaces],
                     pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    os.close(read_end)
    return write_end


class EmulatedNetwork:
    """The namespaces, bridge and links of one emulated network (see topology.py for the names)."""

    def __init__(self, spec: NetSpec):
        self.spec = spec
        self.names = Names.for_this_process(spec.nodes)
        self._reaper_fd: int | None = None
        self.removed_leftovers: list[str] = []

    # -- building ------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        self.removed_leftovers = remove_leftovers()
        self._reaper_fd = _start_reaper(self.names)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _build(self) -> None:
        n, sw = self.names, self.names.switch
        for ns in n.namespaces:
            _ip("netns", "add", ns)
            # No IPv6: its neighbour discovery would add stray packets to the byte counters. No tail
            # loss probes: on a loaded machine an ACK can be processed after TLP's 10 ms, and the
            # probe sends data again that the counters would see twice (docs/network.md).
            _sysctl(ns, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                    "net.ipv4.tcp_early_retrans=0")
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", BRIDGE, "mtu", str(MTU), "type", "bridge")
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        for k in range(self.spec.nodes):
            node, port = n.node(k), n.port(k)
            # Created in the switch namespace with its peer placed straight into the node's: the
            # pair never exists in the host's namespace.
            _ip("-n", sw, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name", NODE_IF,
                "mtu", str(MTU), "netns", node)
            _ip("-n", sw, "link", "set", port, "master", BRIDGE, "up")
            _ip("-n", node, "addr", "add", f"{n.address(k)}/{PREFIX_LEN}", "dev", NODE_IF)
            _ip("-n", node, "link", "set", NODE_IF, "up")
        self._shape()

    def _shape(self) -> None:
        s, n = self.spec, self.names
        half_delay = s.latency_ms / 2
        if s.latency_ms and not shaping.has_qdisc(n.switch, "netem"):
            raise NetSetupError(
                f"net.latency_ms={s.latency_ms:g} needs tc's netem qdisc, which this kernel lacks "
                "(CONFIG_NET_SCH_NETEM): use net.latency_ms=0 (rates and net.loss_pct work without it)")
        cmds = []
        for k in range(s.nodes):
            cmds += shaping.shape_commands(n.node(k), NODE_IF, s.inter_mbit, half_delay)   # node k's upload
            cmds += shaping.shape_commands(n.switch, n.port(k), s.inter_mbit, half_delay)  # node k's download
            cmds += shaping.shape_commands(n.node(k), "lo", s.intra_mbit, 0)               # node k's intra link
        if s.loss_pct:
            cmds += shaping.sink_commands(n.switch)
            for k in range(s.nodes):
                cmds += shaping.loss_commands(n.switch, n.port(k), s.loss_pct)
        for cmd in cmds:
            try:
                shaping.run(cmd)
            except shaping.ShapingError as e:
                raise NetSetupError(str(e)) from None

    # -- using ---------------------------------------------------------------------------------
    def node_command(self, k: int, cmd: list[str]) -> list[str]:
        """`cmd` run inside node k's namespace (`ip netns exec` also mounts a /sys that shows the
        namespace's own interfaces, which the byte counters are read from)."""
        return ["ip", "netns", "exec", self.names.node(k), *cmd]

    # -- taking down ---------------------------------------------------------------------------
    def close(self) -> None:
        delete_namespaces(self.names.namespaces)
        if self._reaper_fd is not None:
            os.close(self._reaper_fd)  # the reaper wakes, finds nothing left, and exits
            self._reaper_fd = None


def _sysctl(ns: str, *settings: str) -> None:
    _ip("netns", "exec", ns, "sysctl", "-q", "-w", *settings)


def _reap(read_fd: int, namespaces: list[str]) -> None:
    """The reaper: wait until the launcher is gone, then delete what it may have left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the launcher, not for us
    with os.fdopen(read_fd, "rb") as pipe:
        pipe.read()  # returns at end of file: every holder of the write end has exited or closed it
    delete_namespaces(namespaces, grace_s=2.0)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--reap":
        _reap(int(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit("usage: python -m parallel.net.netns --reap FD NAMESPACE...")
