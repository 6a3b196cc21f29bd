"""On loopback the kernel's byte counters equal the run's log, strategy plus tooling, within 3%.

Every byte a run sends goes through a Communicator and into its log (parallel/dist/comm.py); the
loopback probe, which runs after the steps, too. Checked for dp, tp and pp_1f1b at world 2
(model=small, 4 steps), each probing its own link as a run without `virtual.loopback_*` does.

How only the run's bytes are counted: the runs are launched with torchrun inside a network
namespace of their own (parallel/net/netns.py's EmulatedNetwork with one node and nothing shaped:
IPv6 off, TCP's tail loss probes off, deleted however the test ends), where every byte of the job
(rendezvous, the TCP store, gloo) crosses that namespace's `lo` and nothing else does. Its
counters (/sys/class/net/lo/statistics, read inside the namespace) are read before and after each
run.

The kernel's side is the TCP payload: tx_bytes less 52 bytes per frame (tx_packets), the IPv4
(20), TCP (20) and timestamp option (12) headers of each frame, the Ethernet header being off the
loopback's count (parallel/net/predict.py: FRAME_HEADERS["intra"]); a pure acknowledgement is then
0 bytes, a segmentation-offloaded frame its whole payload. The log's side is the summary's
comm.run.sent_bytes (every step's strategy calls), comm.tooling.run.sent_bytes (every step's
tooling calls) and comm.outside_steps.sent_bytes (set-up and the probe), all ranks. What the
kernel counts beyond the log is small against a run that probes its own link: gloo's framing (a
48-byte header per message and the announcements of a transfer), the TCP store's messages, the
gathering of the reports and the shutdown barrier (after the summary's figures were taken), and
TCP's retransmissions (shown in the failure message).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT, Run, assert_ok
from net_launcher import require_network, why_not_available

from parallel.net.netns import EmulatedNetwork
from parallel.net.predict import FRAME_HEADERS
from parallel.net.topology import NetSpec

RUNS = {"dp": ["parallel=dp"], "tp": ["parallel=tp"], "pp_1f1b": ["parallel=pp_1f1b", "parallel.microbatches=4"]}
COMMON = ["model=small", "train.steps=4", "train.warmup_steps=1", "train.peak_flops=1e11", "run.timeline=false"]
TOLERANCE = 0.03


def lo_counters(namespace: str) -> dict[str, int]:
    """lo's tx byte and packet counters and TCP's retransmitted segments, inside `namespace`."""
    stats = "/sys/class/net/lo/statistics"
    out = subprocess.run(["ip", "netns", "exec", namespace, "sh", "-c",
                          f"cat {stats}/tx_bytes {stats}/tx_packets; grep '^Tcp:' /proc/net/snmp"],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    header, values = out[2].split(), out[3].split()
    return {"tx_bytes": int(out[0]), "tx_packets": int(out[1]),
            "retransmitted": int(values[header.index("RetransSegs")])}


def logged_bytes(summary: dict) -> float:
    comm = summary["comm"]
    return comm["run"]["sent_bytes"] + comm["tooling"]["run"]["sent_bytes"] + comm["outside_steps"]["sent_bytes"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """{strategy: (its Run, the counters' differences over it)}, each run alone in the namespace."""
    require_network(why_not_available(tools=("ip",)))
    spec = NetSpec.from_config({"name": "loopback_bytes", "nodes": 1, "procs_per_node": 2, "inter_mbit": None,
                                "intra_mbit": None, "latency_ms": 0, "loss_pct": 0, "timeout_s": 600})
    out = {}
    with EmulatedNetwork(spec) as net:
        namespace = net.names.node(0)
        for name, overrides in RUNS.items():
            run_dir = tmp_path_factory.mktemp(name) / "run"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "-m", "launch.train", *COMMON, *overrides, f"run.dir={run_dir}"]
            before = lo_counters(namespace)
            proc = subprocess.run(net.node_command(0, cmd), cwd=PROJECT_ROOT, capture_output=True, text=True,
                                  timeout=400, env={**os.environ, **CPU_ONLY})
            after = lo_counters(namespace)
            out[name] = (Run(proc.returncode, proc.stdout, proc.stderr, run_dir),
                         {k: after[k] - before[k] for k in after})
    return out


@pytest.mark.parametrize("strategy", list(RUNS))
def test_the_kernels_bytes_equal_the_log(counted, strategy):
    run, delta = counted[strategy]
    assert_ok(run)
    summary = run.summary
    kernel = delta["tx_bytes"] - FRAME_HEADERS["intra"] * delta["tx_packets"]
    logged = logged_bytes(summary)
    print(f"{strategy}: kernel {kernel / 1e6:.2f} MB of TCP payload ({delta['tx_bytes'] / 1e6:.2f} MB in "
          f"{delta['tx_packets']} frames, {delta['retransmitted']} retransmitted) | log {logged / 1e6:.2f} MB "
          f"(strategy {summary['comm']['run']['sent_bytes'] / 1e6:.2f}, tooling in the steps "
          f"{summary['comm']['tooling']['run']['sent_bytes'] / 1e6:.4f}, outside them "
          f"{summary['comm']['outside_steps']['sent_bytes'] / 1e6:.2f}) | kernel / log {kernel / logged:.4f}")
    assert abs(kernel - logged) <= TOLERANCE * logged, (
        f"{strategy}: the kernel counted {kernel:.0f} bytes of TCP payload, the log {logged:.0f} "
        f"({kernel / logged:.3f}x; {delta['retransmitted']} segments retransmitted)")
    # The probe's bytes are there, as tooling, and none of the strategy's figures hold them.
    outside = summary["comm"]["outside_steps"]["by_tag"]
    assert outside["tooling/probe/payload"]["sent_bytes"] > 0, outside
    assert summary["virtual"]["link_model"]["source"].startswith("probed in this run")
    assert not any(tag.startswith("tooling/") for tag in summary["comm"]["by_tag"])
