"""Keep gloo's event-loop thread from taking a core away from the thread it is waiting for.

gloo's TCP transport runs one event-loop thread per device (named `gloo_tcp_loop`): it sleeps in
`epoll_wait` until a socket is readable or writable, then calls the pair's `handleEvents`. That
function only *tries* the pair's lock (gloo/transport/tcp/pair.cc: "attempt to lock the pair and
skip handling the events until the next tick if the lock cannot be acquired"), and epoll is
level-triggered, so while another thread of the rank holds the lock (the rank's own thread
posting a send, or a ProcessGroupGloo worker running a collective's ring) the loop thread goes
straight back into `epoll_wait`, which returns at once: it spins.

Spinning is harmless while the lock holder runs on another core. It is not when the loop thread
woke up on the lock holder's core: Linux lets a freshly woken thread preempt the running one, so
the loop thread takes the core from the very thread it waits for, and nothing moves until the
scheduler's next tick takes it back (4 ms at HZ=250). With every thread of two ranks on one core,
a small send/receive ping-pong then lasts a tick each way; with a core per rank, a share of small
all-reduces still does (`lab/gloo_call_costs.py` shows both, and how the policy below removes
most of them). The stall is gloo's, not the network's: a plain TCP ping-pong between the same two
processes never stalls.

`SCHED_BATCH` is the Linux policy for a thread that should not preempt others when it wakes; it
keeps its normal share of the CPU (the same weight as nice 0), so under load the loop thread is
not starved, it only waits for the running thread's slice instead of taking the core at once.
Setting it needs no privilege (a thread may always lower its own claim). Nothing a rank computes
changes: only which thread the kernel runs first.

The price is paid where *other* processes keep the cores busy: the loop thread then waits out
their slices too, where under the default policy it would have taken the core at once: beside a
busy process per core, a step is much longer under `batch` (docs/gloo-event-loop.md). Hence the choice,
and `batch` as the default for what this sandbox runs on: a machine whose cores are its ranks'.

`train.gloo_loop_policy` chooses: `batch` (the default: every gloo event-loop thread of the rank
is set to SCHED_BATCH once its process groups exist) or `normal` (SCHED_OTHER, the kernel's
default, as a plain PyTorch job has it). Under NCCL there is no such thread and the choice
changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

GLOO_LOOP_POLICIES = ("batch", "normal")
LOOP_THREAD_NAME = "gloo_tcp_loop"  # gloo's tcp::Loop names its thread so (pthread_setname_np)


def gloo_loop_threads(pid: int | str = "self") -> list[int]:
    """Thread ids of the gloo event-loop threads of process `pid` (this one by default; Linux);
    [] where there are none or no /proc to read."""
    tids = []
    try:
        entries = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in entries:
        try:
            if (task / "comm").read_text().strip() == LOOP_THREAD_NAME:
                tids.append(int(task.name))
        except (OSError, ValueError):  # the thread ended while we looked
            continue
    return sorted(tids)


def apply_gloo_loop_policy(choice: str) -> str:
    """Set this process's gloo event-loop threads as `train.gloo_loop_policy` says; returns what
    they now are, in words, for the run's log.

    Idempotent and cheap (a look at /proc/self/task): call it after the process groups exist, and
    again after a step that may have made groups lazily (PyTorch's own strategies do).
    """
    if choice not in GLOO_LOOP_POLICIES:
        raise ValueError(f"train.gloo_loop_policy={choice!r}: choose one of {', '.join(GLOO_LOOP_POLICIES)}")
    if not hasattr(os, "SCHED_BATCH"):
        return f"normal (train.gloo_loop_policy={choice} has no effect here: no SCHED_BATCH on this system)"
    tids = gloo_loop_threads()
    policy = os.SCHED_BATCH if choice == "batch" else os.SCHED_OTHER
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended (a group destroyed) while we looked
            continue
    if not tids:
        return f"{choice} (no gloo event-loop thread in this process)"
    if choice == "normal":
        return f"normal ({len(tids)} gloo event-loop thread(s) at the kernel's default policy, SCHED_OTHER)"
    return f"batch ({len(tids)} gloo event-loop thread(s) set to SCHED_BATCH: they no longer preempt on wake-up)"
