"""One training job on emulated nodes: `python -m launch.run net=<preset> <launch.train overrides>`.

    python -m launch.run net=ethernet_1g parallel=dp model=tiny train.steps=6     # 2 nodes x 1 rank, 1 Gbit/s
    python -m launch.run net=cluster parallel=tp                                   # 2 x 2, fast intra, slow inter
    python -m launch.run net=ethernet_1g net.inter_mbit=200 link_fault.kind=down link_fault.at_step=3
    python -m launch.run parallel=dp                                              # net=none: plain torchrun
    python -m launch.run net=cluster agent.max_restarts=1 agent_fault.node=1 agent_fault.at_step=5 \
        train.resume=auto train.checkpoint_every=2 train.steps=10                # node 1's agent lost, the job goes on

Every override but `net.*`, `agent.*`, `link_fault.*` and `agent_fault.*` goes to launch.train
unchanged. agent.max_restarts is torchrun's --max-restarts, given to every node's agent; on
emulated nodes launch.run also starts a fresh agent in place of one that dies (parallel/net/agents.py).
net=none (the default) is `torchrun --standalone --nproc-per-node <net.procs_per_node>` on this
machine: no privileges needed. Any other preset builds the network of parallel/net/ (one Linux network namespace per
node, a bridge in a namespace of its own, shaped veth links: docs/network.md) and starts one
torchrun agent inside each node's namespace, with c10d rendezvous on the emulated addresses.
Whatever the tool creates is removed when it ends, however it ends.

Refusals, in one line, exit 2, before anything is created: a bad net setting, a layout that does
not fit net.nodes x net.procs_per_node, and (emulated networks) no root / CAP_NET_ADMIN or no
`ip`/`tc`. A job past net.timeout_s is stopped (exit 124). A failed job ends with one line; when
nodes can no longer reach each other, it names them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# Only torch-free modules here: a bad net setting is refused before torch is even imported.
from launch.config import CODE_ROOT, CONFIG_DIR, unknown_preset
from parallel.dist.binding import threads_per_rank
from parallel.net.agents import (
    ENV_AGENT,
    FRESH_AGENT_ENV,
    RDZV_KEEP_ALIVE,
    AgentFault,
    AgentKiller,
    AgentReplacer,
    max_restarts_from_config,
)
from parallel.net.faults import FaultInjector, LinkFault, unreachable_nodes
from parallel.net.netns import EmulatedNetwork, NetSetupError, stop_processes
from parallel.net.placement import ENV_NAMESPACES
from parallel.net.probe import ENV_IFNAME, ENV_NODE, ENV_SETTINGS
from parallel.net.shaping import dropped_frames
from parallel.net.topology import NODE_IF, NetConfigError, NetSpec

RDZV_PORT = 29400          # inside node 0's own namespace: no other process can hold it
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
OWN_GROUPS = ("net", "agent", "link_fault", "agent_fault")


class Refused(Exception):
    """A run that must not start; the message is the one line to print."""


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_on_signal(signum, _frame):
    raise Interrupted(signum)


# -- checks before anything is created ----------------------------------------------------------

def _capabilities() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges(spec: NetSpec) -> None:
    """Namespaces need CAP_SYS_ADMIN (`ip netns add` mounts), links and qdiscs CAP_NET_ADMIN."""
    missing_tools = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing_tools:
        verb = "are" if len(missing_tools) > 1 else "is"
        raise Refused(f"net={spec.name} needs the iproute2 tools, and {' and '.join(missing_tools)} {verb} not on PATH "
                      "(install iproute2); net=none runs without them")
    caps = _capabilities()  # root has every capability; a root without them (a container) can do nothing here
    needed = ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
    missing = [name for bit, name in needed if not caps >> bit & 1]
    if missing:
        raise Refused(f"net={spec.name} creates network namespaces, which needs root (CAP_NET_ADMIN and "
                      f"CAP_SYS_ADMIN), and this process lacks {' and '.join(missing)}; "
                      "net=none runs without privileges")


def check_plan(cfg: DictConfig, spec: NetSpec):
    """The training configuration, validated for the world the network gives (launch.train's own checks)."""
    from parallel.core.data import DataError
    from parallel.dist.dims import LayoutError
    from parallel.dist.groups import LaunchEnv
    from parallel.reliability.checkpoint import CheckpointError
    from parallel.run_plan import ConfigError, build_plan

    env = LaunchEnv(rank=0, world_size=spec.world_size, local_rank=0, local_world_size=spec.procs_per_node)
    if cfg.train.resume == "auto" and cfg.run.dir is None:
        # launch.run names a new run directory itself (train_overrides), the same for every agent and
        # attempt: checked here as an empty one, which it is.
        cfg = OmegaConf.merge(cfg, {"run": {"dir": str(Path(tempfile.gettempdir()) / f"launch-run-{os.getpid()}")}})
    try:
        plan = build_plan(cfg, env, cuda_available=False if spec.emulated else _cuda_available())
    except (ConfigError, LayoutError, DataError, CheckpointError) as e:
        raise Refused(f"{e} (net={spec.name} runs net.nodes x net.procs_per_node = {spec.nodes} x "
                      f"{spec.procs_per_node} = {spec.world_size} processes)") from None
    if spec.emulated and plan.backend == "nccl":
        raise Refused(f"parallel.backend=nccl with net={spec.name}: the emulated links shape kernel TCP, which "
                      "gloo uses and NCCL does not; use parallel.backend=gloo (or auto)")
    return plan


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def train_overrides(cfg: DictConfig, spec: NetSpec, plan) -> tuple[list[str], Path]:
    """The command line's overrides minus this tool's own, plus a run directory (the tool watches
    its metrics.jsonl) and, where unset, a share of the cores: the emulated nodes share this
    machine, so each rank gets cores / world, not cores / ranks of its node."""
    from parallel.report.metrics import default_run_dir

    overrides = [o for o in HydraConfig.get().overrides.task
                 if not any(o.lstrip("+~").startswith((g + ".", g + "=")) for g in OWN_GROUPS)]
    run_dir = Path(cfg.run.dir or default_run_dir(plan.strategy, spec.world_size)).absolute()
    overrides = [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={run_dir}"]
    if cfg.train.threads is None:
        overrides.append(f"train.threads={threads_per_rank(spec.world_size)}")
    return overrides, run_dir


# -- running ---------------------------------------------------------------------------------

def _env(spec: NetSpec, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(CODE_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, ENV_SETTINGS: json.dumps(spec.as_dict()), **extra}


def agent_command(spec: NetSpec, node: int, addresses: list[str], rdzv_id: str, overrides: list[str],
                  max_restarts: int = 0) -> list[str]:
    """Node `node`'s torchrun agent: c10d rendezvous hosted by node 0's agent on its emulated address.
    With net.placement=cyclic its workers start through parallel/net/placement.py, which moves each
    to the node its rank belongs on. With restarts, a dead agent's heartbeat expires sooner, so a
    fresh one can join (RDZV_KEEP_ALIVE)."""
    placed = ["parallel.net.placement"] if spec.placement != "block" else []
    rdzv_conf = f"is_host={1 if node == 0 else 0}" + (f",{RDZV_KEEP_ALIVE}" if max_restarts else "")
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.procs_per_node}", f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={addresses[0]}:{RDZV_PORT}", f"--rdzv-id={rdzv_id}",
        f"--local-addr={addresses[node]}", f"--rdzv-conf={rdzv_conf}",
        # The agent polls the rendezvous every monitor interval, across the emulated link: once a
        # second keeps that off the byte counters (0.1 s is torchrun's default).
        "--monitor-interval=1",
        "-m", *placed, "launch.train", *overrides,
    ]


def wait_for(procs: list[subprocess.Popen], deadline: float, grace_s: float = 5.0,
             replace=None) -> tuple[list[int | None], bool, float | None]:
    """Wait for every process, or until one fails (then `grace_s` more for the others to end on
    their own), or the deadline. Returns the exit codes (None: still running), whether the
    deadline passed, and when the first process failed (time.monotonic(); None: none did).
    `replace(k, code)` may return a process to take the place of procs[k], which just ended
    (None: it stays ended)."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        for k, code in enumerate(codes):
            if code not in (None, 0) and failed_at is None and replace and (fresh := replace(k, code)):
                procs[k], codes[k] = fresh, None
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if all(c is not None for c in codes):
            return codes, False, failed_at
        if now >= deadline:
            return codes, True, failed_at
        if failed_at is not None and now - failed_at >= grace_s:
            return codes, False, failed_at
        time.sleep(0.1)


def run_standalone(spec: NetSpec, overrides: list[str], max_restarts: int = 0) -> int:
    """net=none: exactly the plain torchrun command, on this machine, with no emulated network."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.procs_per_node}",
           f"--max-restarts={max_restarts}", "-m", "launch.train", *overrides]
    proc = subprocess.Popen(cmd, env=_env(spec), start_new_session=True)
    try:
        codes, timed_out, _ = wait_for([proc], time.monotonic() + spec.timeout_s)
    finally:
        _stop(proc)
    if timed_out:
        print(f"error: the job ran past net.timeout_s={spec.timeout_s:g} s and was stopped", file=sys.stderr,
              flush=True)
        return 124
    return codes[0] if codes[0] is not None else 1


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the agent's session (it stops its workers), SIGKILL what remains."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_emulated(spec: NetSpec, overrides: list[str], run_dir: Path, fault: LinkFault | None,
                 max_restarts: int = 0, agent_fault: AgentFault | None = None) -> int:
    with EmulatedNetwork(spec) as net:
        if net.removed_leftovers:
            print(f"launch.run: removed {len(net.removed_leftovers)} namespace(s) left by a crashed run: "
                  f"{', '.join(net.removed_leftovers)}", file=sys.stderr, flush=True)
        print(f"launch.run: network {net.names.switch} + {spec.nodes} node namespaces ({spec.nodes} x "
              f"{spec.procs_per_node} ranks), launcher pid {os.getpid()}", file=sys.stderr, flush=True)
        addresses = [net.names.address(k) for k in range(spec.nodes)]
        rdzv_id = f"net{os.getpid()}"

        def start_agent(k: int) -> subprocess.Popen:
            command = agent_command(spec, k, addresses, rdzv_id, overrides, max_restarts)
            env = _env(spec, GLOO_SOCKET_IFNAME=NODE_IF, **{ENV_IFNAME: NODE_IF, ENV_NODE: str(k), ENV_AGENT: str(k)},
                       **{ENV_NAMESPACES: json.dumps(net.names.namespaces[1:])}, CUDA_VISIBLE_DEVICES="",
                       **(FRESH_AGENT_ENV if max_restarts else {}))
            return subprocess.Popen(net.node_command(k, command), env=env, start_new_session=True)

        started = time.monotonic()
        procs = [start_agent(k) for k in range(spec.nodes)]
        metrics = run_dir / "metrics.jsonl"
        injectors = [FaultInjector(fault, net, metrics) if fault else None,
                     AgentKiller(agent_fault, procs, metrics) if agent_fault else None]
        for thread in filter(None, injectors):
            thread.start()
        codes, timed_out, failed_at = wait_for(procs, started + spec.timeout_s,
                                               replace=AgentReplacer(net, start_agent, max_restarts))
        for thread in filter(None, injectors):
            thread.stop()
        report_losses(net, fault)
        # Stop what still runs (an agent whose peer is unreachable can wait minutes in torchrun's
        # rendezvous shutdown), with the network still up, so the verdict can probe it.
        stop_processes(net.names.namespaces)
        ended_at = time.monotonic()  # the job's end: nothing of it runs any more
        return _outcome(net, spec, codes, timed_out, injectors[0], failed_at, ended_at)


def _outcome(net: EmulatedNetwork, spec: NetSpec, codes: list[int | None], timed_out: bool, injector,
             failed_at: float | None, ended_at: float) -> int:
    """The job's exit code, and its one line when it failed."""
    if injector and injector.error:
        print(f"error: link_fault could not be applied: {injector.error}", file=sys.stderr, flush=True)
        return 1
    if timed_out:
        print(f"error: the job ran past net.timeout_s={spec.timeout_s:g} s and was stopped", file=sys.stderr,
              flush=True)
        return 124
    failed = [(k, c) for k, c in enumerate(codes) if c not in (0, None)]
    if not failed and all(c == 0 for c in codes):
        return 0
    print(f"error: {verdict(net, spec, failed, injector, failed_at, ended_at)}", file=sys.stderr, flush=True)
    return failed[0][1] if failed else 1


def report_losses(net: EmulatedNetwork, fault: LinkFault | None) -> None:
    """How many frames the loss filters dropped (their retransmissions are in the byte counters)."""
    if not net.spec.loss_pct and not (fault and fault.kind == "loss"):
        return
    dropped = sum(dropped_frames(net.names.switch, net.names.port(k)) for k in range(net.spec.nodes))
    print(f"launch.run: the loss filters dropped {dropped} frames", file=sys.stderr, flush=True)


def verdict(net: EmulatedNetwork, spec: NetSpec, failed: list[tuple[int, int]], injector,
            failed_at: float | None, ended_at: float) -> str:
    """The one line that ends a failed job: which nodes are unreachable and why, when that is the cause."""
    agents = ", ".join(f"node {k}'s agent exited {c}" for k, c in failed) or "an agent stopped"
    cut_off = unreachable_nodes(net)
    if not cut_off:
        return f"the job failed ({agents}); every node still reaches every other, so the network is not the cause"
    ranks = {k: _ranks_text([r for r in range(spec.world_size) if spec.node_of_rank(r) == k]) for k in cut_off}
    peers = "; ".join(f"node {k} ({net.names.address(k)}, {ranks[k]}) is unreachable: {why}"
                      for k, why in cut_off.items())
    when = ""
    if injector is not None and injector.applied_at is not None and failed_at is not None:
        when = (f" ({injector.describe()}; the first agent failed {failed_at - injector.applied_at:.1f} s later, "
                f"the job ended {ended_at - injector.applied_at:.1f} s after it)")
    return f"{peers}{when}; the job stopped ({agents})"


def _ranks_text(ranks: list[int]) -> str:
    """"rank 1", "ranks 2-3" (consecutive, block placement) or "ranks 1, 3" (cyclic)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


@hydra.main(config_path=CONFIG_DIR, config_name="run", version_base="1.3")
def main(cfg: DictConfig) -> None:
    signal.signal(signal.SIGTERM, _raise_on_signal)
    signal.signal(signal.SIGINT, _raise_on_signal)
    try:
        spec = NetSpec.from_config(cfg.net)
        fault = LinkFault.from_config(cfg.link_fault, spec.nodes, cfg.train.steps)
        if fault and not spec.emulated:
            raise Refused("link_fault needs an emulated network (net=none has no links to break): e.g. net=ethernet_1g")
        max_restarts = max_restarts_from_config(cfg.agent)
        agent_fault = AgentFault.from_config(cfg.agent_fault, spec.nodes, cfg.train.steps)
        if spec.emulated:
            check_privileges(spec)
        plan = check_plan(cfg, spec)
        overrides, run_dir = train_overrides(cfg, spec, plan)
    except (Refused, NetConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        code = (run_emulated(spec, overrides, run_dir, fault, max_restarts, agent_fault) if spec.emulated
                else run_standalone(spec, overrides, max_restarts))
    except NetSetupError as e:
        print(f"error: the emulated network could not be built (nothing is left behind): {e}",
              file=sys.stderr, flush=True)
        code = 1
    except Interrupted as e:
        print(f"launch.run: stopped by {e}; the job and its network are removed", file=sys.stderr, flush=True)
        code = 128 + e.signum
    sys.exit(code)


def cli() -> None:
    """The entry point: a preset that does not exist is refused in the project's one line, exit 2,
    before Hydra (and before any network or process exists)."""
    unknown = unknown_preset(sys.argv[1:])
    if unknown:
        print(f"error: {unknown}", file=sys.stderr, flush=True)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
