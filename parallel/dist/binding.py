"""A core of its own for each rank, when the machine has one for every rank (`train.pin_cores`).

The virtual clock (parallel/replay/) replays a step as if each rank had a core of its own, and the
wall clock of a run with a core per rank is what it is checked against. Left to itself, Linux does
not give a rank a core: it moves every thread of every rank to whichever core is free at each
wake-up, so a rank's compute thread, its gloo threads and the other ranks' gloo threads meet on
both cores in turn, and each handoff of a gloo call wakes its next thread on the other core.
Bound, a rank's threads stay on one core and hand off there: its steps are shorter and steadier,
with the same losses to the bit (docs/core-binding.md). This is what MPI launchers do
by default (`--bind-to core` where there are at least as many cores as processes).

`round_robin`: on the CPU, every rank on cores of its own whatever their number, rank i's
`threads` cores dealt in turn (rank i on core i mod C with one thread each). With more ranks
than cores several ranks share a core, and only their own: the kernel no longer chooses, at each
wake-up, which core a thread runs on. The replay then knows which ranks share which core
(`python -m launch.replay <run> cores=bound`) and reproduces the machine by processor sharing of
each core among its ranks (parallel/replay/engine.py); the virtual-time bench's contention check
makes its world-4 runs this way (docs/virtual-time.md, where the unbound runs' shortfall is).

`auto` (the default): on the CPU, when every rank of this machine can have `threads` cores (one
per rank, or `train.threads` each) out of the cores the process may use, rank i of the machine
takes the i-th block of them; every thread it has is moved there, and threads made later inherit
it. Otherwise nothing is bound, and the log says why: more ranks than cores (the contention the
virtual clock replays away), one rank that has every core already, or a GPU run. `off` binds
nothing.

Which ranks share a machine is decided by the kernel's boot id, not the hostname: containers on
one host have hostnames of their own, and the emulated nodes of `launch.run` or a Slurm test
cluster on one host share both the cores and the hostname, with LOCAL_RANK 0 on each.

A bound rank sees one core in its own affinity; what the machine has for its ranks together (the
CPU's peak FLOP/s is the machine's, parallel/report/mfu.py) stays readable in HOST_CORES_ENV,
which the binding sets before it narrows the process.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PIN_CHOICES = ("auto", "off", "round_robin")
HOST_CORES_ENV = "PARALLEL_HOST_CORES"  # the cores the machine's ranks share, set before a rank narrows itself


def allowed_cores() -> list[int]:
    """The cores this thread may run on, in order (where the system cannot say, every CPU it has):
    a container often sees more CPUs in os.cpu_count() than it is allowed."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def threads_per_rank(local_world_size: int, requested: int | None = None) -> int:
    """Share the cores among the ranks of this machine, so 4 ranks on 2 cores do not fight."""
    if requested:
        return requested
    return max(1, len(allowed_cores()) // local_world_size)


def machine_id() -> str:
    """What identifies the machine whose cores this process shares: the running kernel's boot id
    (the same in every container and network namespace of one host), else the hostname."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket
        return socket.gethostname()


def slot_on_machine(ids: list[str], rank: int) -> tuple[int, int]:
    """(this rank's index among the ranks of its machine, how many ranks its machine has), from
    every rank's `machine_id()` in rank order."""
    mine = [r for r, m in enumerate(ids) if m == ids[rank]]
    return mine.index(rank), len(mine)


def cores_for(slot: int, ranks: int, allowed: list[int], threads: int) -> list[int] | None:
    """The block of `allowed` that rank `slot` of `ranks` takes with `threads` cores each, or None
    when the machine has too few cores for every rank to have its own."""
    if ranks * threads > len(allowed):
        return None
    return allowed[slot * threads:(slot + 1) * threads]


def round_robin_cores(slot: int, allowed: list[int], threads: int) -> list[int]:
    """The `threads` cores rank `slot` takes when the machine's ranks are dealt to its cores in turn,
    however many ranks there are: rank i on core i mod C with one thread each, so 4 ranks on 2
    cores are 2 to a core (ranks 0 and 2 on the first, 1 and 3 on the second)."""
    return sorted({allowed[(slot * threads + j) % len(allowed)] for j in range(threads)})


def move_threads(cores: list[int] | set[int]) -> dict[int, set[int]]:
    """Move every thread of this process onto `cores`; returns each thread's previous cores. A
    thread that ended while we looked is skipped."""
    before = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended while we looked (ProcessLookupError)
            continue
    return before


@contextlib.contextmanager
def bound_to(cores: list[int] | None):
    """Every thread of this process on `cores` for the block, as it was afterwards (None: nothing
    moves). Used by the loopback probe inside a run whose ranks share cores, so that its two
    ranks measure with a core each, as the virtual clock assumes."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = move_threads(cores)
    try:
        yield
    finally:
        for tid, previous in before.items():
            try:
                os.sched_setaffinity(tid, previous)
            except OSError:  # the thread ended while we looked (ProcessLookupError)
                continue


def bind_rank(choice: str, ids: list[str], rank: int, threads: int, device_type: str) -> str:
    """Bind this rank as `train.pin_cores` says, given every rank's `machine_id()`; returns what
    was done, in words, for the run's log."""
    if choice not in PIN_CHOICES:
        raise ValueError(f"train.pin_cores={choice!r}: choose one of {', '.join(PIN_CHOICES)}")
    allowed = allowed_cores()
    slot, ranks = slot_on_machine(ids, rank)
    if choice == "off":
        return f"off (the {ranks} rank(s) of this machine share its {len(allowed)} core(s) as the kernel places them)"
    if not hasattr(os, "sched_setaffinity"):
        return "not bound (this system cannot set a thread's cores)"
    if device_type != "cpu":
        return "not bound (a GPU run: the device computes, not the cores)"
    if choice == "round_robin":
        cores = round_robin_cores(slot, allowed, threads)
    else:
        cores = cores_for(slot, ranks, allowed, threads)
        if cores is None:
            return (f"not bound: {ranks} ranks with {threads} thread(s) each share {len(allowed)} core(s) "
                    "(the contention the virtual clock replays away)")
    if len(cores) == len(allowed):
        if ranks == 1:
            return f"not bound (the one rank of this machine has all its {len(allowed)} core(s))"
        return f"not bound (rank {slot} of this machine's {ranks} would take all its {len(allowed)} core(s))"
    os.environ[HOST_CORES_ENV] = ",".join(str(c) for c in allowed)
    move_threads(cores)
    return (f"rank {slot} of this machine's {ranks} on core(s) {','.join(str(c) for c in cores)} of {len(allowed)}"
            + (" (round_robin)" if choice == "round_robin" else ""))


def host_cores() -> int:
    """How many cores the ranks of this machine share: the process's own affinity, or, in a rank
    that took a core of its own, what the machine's ranks had before they did."""
    shared = os.environ.get(HOST_CORES_ENV)
    if shared:
        return len(shared.split(","))
    return len(allowed_cores())
