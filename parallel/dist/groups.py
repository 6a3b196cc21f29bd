"""Process groups in, process groups out.

`init_distributed` turns the torchrun environment and a validated layout into a `DistContext`: the
device, the backend, the device mesh and one named `Communicator` per mesh dimension (plus
"world"). Nothing is stored globally; the context is passed to whatever needs a group.

`shutdown` tears it down in an order that exits cleanly (see its docstring).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.dist.comm import CommLog, Communicator
from parallel.dist.dims import MESH_DIMS, LayoutError, ParallelDims, build_device_mesh


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun tells each process (defaults: one plain `python` process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        )


def choose_backend(requested: str, cuda_available: bool) -> str:
    """auto: NCCL where CUDA is, gloo elsewhere. NCCL without a GPU is refused, not left to hang."""
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise LayoutError("parallel.backend=nccl needs CUDA GPUs and none is visible: "
                          "use parallel.backend=gloo (or auto)")
    if requested not in ("gloo", "nccl"):
        raise LayoutError(f"parallel.backend={requested!r} is not one of auto, gloo, nccl")
    return requested


def choose_device_type(requested_backend: str, backend: str | None, cuda_available: bool) -> str:
    """Where the tensors live. NCCL: on the GPU (each rank its own, cuda:LOCAL_RANK). One process
    (no backend): on the GPU when one is visible, unless parallel.backend=gloo asks for the CPU.
    gloo: on the CPU (gloo has no send/recv for CUDA tensors, which the pipeline needs)."""
    if backend == "nccl":
        return "cuda"
    if backend is None and requested_backend != "gloo" and cuda_available:
        return "cuda"
    return "cpu"


@dataclass
class DistContext:
    env: LaunchEnv
    dims: ParallelDims
    backend: str | None  # None: a single process, no process group
    device: torch.device
    log: CommLog
    comms: dict[str, Communicator] = field(default_factory=dict)
    mesh: object = None
    peers: list = field(default_factory=list)  # (hostname, pid, machine id) per rank: failure messages, binding
    gloo_loop_policy: str | None = None  # train.gloo_loop_policy, for tools that make groups as they go (gloo_loop.py)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coordinates(self.env.rank)

    def comm(self, name: str) -> Communicator | None:
        return self.comms.get(name)


def nccl_failure_env() -> dict[str, str]:
    """What NCCL's process groups are made under, so that a failed or hung collective ends in an
    exception on the rank's own thread, which launch/train.py prints as the one `error:` line.

    torch 2.13's ProcessGroupNCCL checks every collective from a watchdog thread: past the group's
    timeout (parallel.timeout_s) or on an NCCL error it marks the collective failed and then acts
    as TORCH_NCCL_ASYNC_ERROR_HANDLING says. torch's default (3) and torchrun's (1) take the whole
    process down from that thread: a SIGABRT, no Python frame, no line. 2 (CleanUpOnly) aborts the
    group's communicators and leaves the process, so the next wait or call on the group raises
    (DistBackendError: "NCCL communicator was aborted on rank N. Original reason for failure
    was: ... Watchdog caught collective operation timeout ..."), which comm.py names.
    TORCH_NCCL_BLOCKING_WAIT=1, which makes every wait itself block and raise, is left to the
    user: it stops the host from running ahead of the GPU at every wait (FSDP2's prefetching
    loses its overlap)."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def init_distributed(env: LaunchEnv, dims: ParallelDims, backend: str, timeout_s: float, log: CommLog,
                     device_type: str | None = None) -> DistContext:
    """Create the process groups for `dims` (already validated) and name them.

    device_type None: CUDA under NCCL, the CPU otherwise (see `choose_device_type`). On CUDA each
    process takes the GPU of its LOCAL_RANK, so the ranks of one node use different GPUs.
    """
    device_type = device_type or ("cuda" if backend == "nccl" else "cpu")
    device = torch.device("cuda", env.local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if env.local_world_size > visible:  # every rank of the node sees it, rank 0 included
            # NCCL refuses two ranks on one GPU; say so before any group exists instead.
            raise LayoutError(
                f"{env.local_world_size} processes on this node run on CUDA, one GPU each, but {visible} GPU(s) "
                f"are visible: launch --nproc-per-node {visible} (or fewer), or set parallel.backend=gloo "
                "to run the ranks on the CPU"
            )
        torch.cuda.set_device(device)
    ctx = DistContext(env=env, dims=dims, backend=None, device=device, log=log)
    if env.world_size == 1:
        return ctx
    if env.local_world_size == env.world_size:
        # One machine: talk over loopback. Hosts whose hostname resolves to an unreachable
        # address otherwise fail gloo's "connectFullMesh".
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        os.environ.update(nccl_failure_env())  # read by every NCCL group as it is made
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend, timeout=timeout, store=attempt_store(env, timeout), rank=env.rank, world_size=env.world_size,
        device_id=device if backend == "nccl" else None,
    )
    ctx.backend = backend
    add_layout_groups(ctx)
    return ctx


def attempt_store(env: LaunchEnv, timeout: datetime.timedelta):
    """torchrun's store (env://: MASTER_ADDR, MASTER_PORT), its keys prefixed by the attempt.

    torchrun's agent keeps one TCPStore for the whole job and hands it to every attempt after a
    restart (--max-restarts) unchanged: the keys the last attempt's groups wrote (each rank's
    address, by group and rank) are still there, so a new rank can read a dead peer's address
    before the new peer overwrites it, and gloo's connectFullMesh then waits out its timeout on a
    port nobody listens on. A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps the attempts
    apart, as the agent's own rendezvous keys are kept apart by round."""
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def add_layout_groups(ctx: DistContext) -> DistContext:
    """The device mesh of `ctx.dims` and one named Communicator per dimension, plus "world", on an
    initialised default process group. Collective: every rank calls it, in the same order. (A
    test that tries several layouts in one job calls it once per layout, on contexts that share
    the default group.)"""
    # Every group gets the run's timeout (the default group's): a rank that hangs inside a tp or dp
    # group is reported after parallel.timeout_s, not after the backend's default minutes.
    timeout = default_group_timeout()
    ctx.mesh = build_device_mesh(ctx.dims, ctx.device.type, group_options(dist.get_backend(), timeout))
    ctx.comms["world"] = Communicator("world", dist.group.WORLD, ctx.log)
    for name in MESH_DIMS:
        ctx.comms[name] = Communicator(name, ctx.mesh[name].get_group(), ctx.log)
    # The groups that are not dimensions of the mesh (dims.DIMS' derived rows: expert parallelism's
    # ep and edp, dp with cp together), made only where the layout uses them.
    for name in ctx.dims.groups_in_use():
        mine, _ = dist.new_subgroups_by_enumeration(ctx.dims.group_ranks(name), timeout=timeout)
        ctx.comms[name] = Communicator(name, mine, ctx.log)
    return ctx


def link_groups(ctx: DistContext, links, name: str = "pp") -> dict:
    """One group of two ranks per link (src, dst), in pipeline ranks, of every pipeline of the
    layout; this rank's, by link. Each carries one direction of one neighbour pair, so that on NCCL
    its ops queue behind nothing but that direction's own (parallel/pp/posting.py). Collective:
    every rank makes every pipeline's groups, in the same order (`links` is computed alike on all).
    Each gets the run's timeout, and its Communicator logs under `name`, the pipeline group's, so
    the bytes of every link add up to the pipeline's figures."""
    timeout = default_group_timeout()
    mine = {}
    for pipeline in ctx.dims.group_ranks("pp"):  # global ranks in pipeline-rank order
        for link in links:
            members = [pipeline[link.src], pipeline[link.dst]]
            group = dist.new_group(members, timeout=timeout)
            if ctx.rank in members:
                mine[link] = Communicator(name, group, ctx.log)
    return mine


def default_group_timeout() -> datetime.timedelta:
    """The timeout the default process group was made with (parallel.timeout_s)."""
    return group_timeout(dist.group.WORLD)


def group_timeout(group) -> datetime.timedelta:
    """The timeout a process group's backend was made with."""
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout


def group_options(backend: str, timeout: datetime.timedelta):
    """The options a group of `backend` is made with, carrying `timeout`."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options(backend, timeout)


def shutdown(ctx: DistContext) -> None:
    """Wait for every async call, barrier, then destroy the process groups.

    Every handle is waited and released and a barrier makes sure no peer is still sending, so no
    collective is in flight when the groups go away (a gloo group's destructor joins its worker
    threads, which would otherwise wait out the collective's timeout).
    """
    if ctx.backend is None:
        return
    for comm in ctx.comms.values():
        comm.wait_all()
    ctx.comms["world"].barrier(tag="tooling/shutdown")
    ctx.comms.clear()
    ctx.mesh = None
    gc.collect()
    dist.destroy_process_group()
    ctx.backend = None


def exit_process(code: int) -> None:
    """End a worker once its output is flushed, without interpreter finalisation.

    torch 2.13 + gloo: `destroy_process_group()` does not stop gloo's worker threads
    (pt_gloo_runloop, gloo_tcp_loop); they are joined only when the interpreter finalises and
    the last ProcessGroupGloo is collected, and a worker that frees a Python-owned tensor then can
    abort the process ("terminate called without an active exception", exit -6) after all its work
    is done (traced with gdb: Py_FinalizeEx -> ~ProcessGroupGloo -> thread join).
    Skipping finalisation removes that window. Everything this project writes is flushed and
    closed before this is called; `os._exit` skips atexit handlers and buffered I/O, so flush first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_with_error(env: LaunchEnv, message: str, code: int = 2) -> None:
    """Refuse a run in one line and exit non-zero, before any process group exists.

    Every rank reaches the same verdict from the same config, so rank 0 alone says it (one line,
    not one per rank) and leaves at once. The others leave a moment later, silently: torchrun
    stops every worker as soon as the first one exits, and a rank that went first could cut rank
    0 off before its line is out. (torchrun then exits 1 and prints its own report of the failed
    workers after the line; `python -m launch.run` validates first and ends with the line, exit 2.)
    """
    if env.rank != 0:
        time.sleep(2.0)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
    exit_process(code)
