"""launch.run refuses what it cannot run in one line, exit 2, before creating anything.

Without the privileges (root's CAP_NET_ADMIN and CAP_SYS_ADMIN) or without iproute2, every net but
none is refused with what is missing and that net=none works; a zero or negative rate, fewer than
one node, an agent_fault on node 0 (the rendezvous host), and a layout whose world is not
net.nodes x net.procs_per_node, one line each. These run anywhere (no namespace is made); each is
one launch.run process (~1-4 s: a bad net setting is refused before torch is imported).
"""

import ctypes
import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT

from parallel.net.netns import our_namespaces

PR_CAPBSET_DROP = 24


def _without_capabilities():
    """In the child, before exec: drop every capability from the bounding set, so that even root
    gets none at exec (what a container without CAP_NET_ADMIN gives a root process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def _refused(overrides: list[str], env: dict | None = None, preexec_fn=None) -> str:
    before = set(our_namespaces()) if sys.platform == "linux" else set()
    proc = subprocess.run([sys.executable, "-m", "launch.run", *overrides], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **CPU_ONLY, **(env or {})}, preexec_fn=preexec_fn)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not proc.stdout.strip(), proc.stdout
    if sys.platform == "linux":
        assert set(our_namespaces()) == before, "a refused run created a namespace"
    return lines[0]


@pytest.mark.skipif(sys.platform != "linux", reason="capabilities are Linux's")
def test_without_privileges_emulated_networks_are_refused():
    line = _refused(["net=cluster"], preexec_fn=_without_capabilities)
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in line and "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in line
    assert "net=none runs without privileges" in line


def test_without_iproute2_emulated_networks_are_refused():
    # Only the interpreter's own directory on PATH: no `ip`, no `tc`.
    line = _refused(["net=ethernet_1g"], env={"PATH": os.path.dirname(sys.executable)})
    assert "needs the iproute2 tools, and ip and tc are not on PATH" in line and "net=none runs without them" in line


@pytest.mark.parametrize("override,expected", [
    ("net.inter_mbit=0", "error: net.inter_mbit=0 must be a positive number of Mbit/s (or null: unshaped)"),
    ("net.intra_mbit=-100", "error: net.intra_mbit=-100 must be a positive number of Mbit/s (or null: unshaped)"),
    ("net.nodes=0", "error: net.nodes=0 must be an integer in 1..100"),
    ("agent_fault.node=0", "error: agent_fault.node=0 must be a node 1..1: node 0's agent hosts the rendezvous "
                           "store, and the job cannot outlive it"),
])
def test_bad_network_settings_are_refused(override, expected):
    assert _refused(["net=cluster", override]) == expected


def test_a_layout_that_does_not_fit_the_nodes_is_refused():
    line = _refused(["net=ethernet_1g", "parallel=tp", "parallel.tp=2", "parallel.dp=2"])
    assert "world size 2 != parallel.dp x parallel.tp x parallel.pp = 2 x 2 x 1 = 4" in line
    assert "net=ethernet_1g runs net.nodes x net.procs_per_node = 2 x 1 = 2 processes" in line
