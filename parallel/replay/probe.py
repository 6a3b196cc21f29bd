"""This machine's loopback as a link model: probed inside a run, with one rank per core, as a run uses it.

The replay needs the rate and the per-step latency one rank's transfers reach when it has a core
of its own, not the contended figures of N ranks on fewer cores. So two ranks of one node (global
rank 0 and the next rank on its node) measure them between themselves, after the timed steps,
while every other rank waits for the figures (in a gloo broadcast's receive, which takes no core).
Each of the two is bound to a core of its own while it measures, its gloo threads with it, as a
virtual rank's core is (a run bound by `train.pin_cores` already is; parallel/dist/binding.py):
unbound, each handoff of a call may wake its thread on the other core, and a call costs several
times the latency (docs/core-binding.md).

They measure a collective the way a training step meets one: **coming out of compute, and on
average**. Each timed all-reduce follows a burst of matmuls on both ranks (at least `BURST_S` of
thread CPU time), and the figure is the mean over many, not the best.

The burst works on more memory than the core's L2 cache holds (`burst_side`: the product of an
n x n matrix reads and writes twice the L2), as a step's compute between two calls does: it
leaves none of gloo's buffers, its threads' stacks or the call's code in the cache, and the call
pays for fetching them again. A burst that fits in L1 leaves them, and times only the cheap
calls, which replays a step under its wall time (docs/virtual-time.md, "The probe's burst").

Even with a core per rank a gloo all-reduce's time is spread wide, its median well above its best
and its tail far above its median: each call hands work between the rank's thread, a gloo worker
thread and gloo's event-loop thread, and each handoff waits for a wake-up. (Under the kernel's
default policy for gloo's event loop, `train.gloo_loop_policy=normal`, some calls also wait a
scheduler tick: parallel/dist/gloo_loop.py. The probe's ranks set the same policy as the runs.)
The best of a burst of back-to-back calls, the planner's method (parallel/planner/loopback.py),
misses the handoffs, and a step of such calls is then replayed at a fraction of its wall time. A
step pays the mean cost of each call, so the mean is the figure.

Each call is timed **from the later of the two ranks' posts** (`from_last_post`), as the replay
starts an op when its last member has posted it. The two bursts end apart (two cores do not
finish their products of an L2-sized matrix at the same moment), and a rank's own call time
holds that wait for the other, which is not the link's. Both ranks stamp their calls on the
host's monotonic clock, one clock for the two processes of one node:

    latency   the mean time of a small all-reduce (SMALL_BYTES, whose bytes take microseconds)
              over its 2(n-1) = 2 ring steps, less those bytes' time
    rate      the bytes one rank sends in an all-reduce of PAYLOAD_BYTES (2(n-1)/n S = S at n = 2)
              over its mean time less the two steps' latency
    p2p       one message's latency: half the mean time of a SMALL_BYTES ping-pong (a send and a
              receive each way), less its bytes' time. gloo runs a send or a receive on the
              calling thread and a collective on the group's worker threads, so a message makes
              fewer handoffs than a ring step (lab/gloo_call_costs.py shows the two
              distributions)

The first two from the same bursts, so the two equations t = 2 L + sent / rate are solved
together. A figure given in the config (`virtual.loopback_gbytes_per_s`,
`virtual.loopback_latency_us`, `virtual.loopback_p2p_latency_us`) is used as given instead:
launch.compare and bench/virtual_time measure it once for all their runs (`measure_once`: the
median of three runs of this module under `python -m torch.distributed.run --nproc-per-node 2 -m
parallel.replay.probe`; `figure_overrides` hands them on), and bench/virtual_time also
probes once before each run and replays its batch on their median afterwards (`run_probe`, its
`loopback=sampled`).

**Every byte logged, as few as the figures' accuracy allows.** The probe's calls cross the same
loopback as the run's, so they go through a `Communicator` (parallel/dist/comm.py) and the run's
log holds them under TAG: tooling, kept apart from the strategy's figures. A call is timed around
the Communicator's, its record included, as a run's span leaves that record's CPU out of the
compute between calls (its CPU end follows the record). Nearly all its bytes are the payload
all-reduces'. The payload itself cannot shrink: the rate is its bytes over the difference of two
means, which is the bytes' time only where it stands well above the spread of a call's handoffs,
and on a busy host a handoff waits up to a scheduler tick; PAYLOAD_BYTES at a loopback's few GB/s
takes milliseconds, as long as such a tick. Their number can: a probe run's figures move from one
run to the next with the host's moment, by more than the sampling error of a few calls (which is
why `measure_once` takes the median of several runs), so calls past that error make no figure
better. The payload all-reduces stop once the standard error of their mean is PRECISION of their
bytes' time (`payload_calls`): at least the fewest of PAYLOAD_REPEATS (a spread from fewer calls
says little), at most the most, which a busy host's calls reach. The small calls keep their counts:
they carry few bytes, and a latency is their mean, whose tail (the calls that wait a tick) only
many calls sample.

The virtual clock models CPU ranks, so a run on GPUs, or under NCCL, probes nothing
(parallel/report/virtual.py: `replayable`); the pair is a gloo group of CPU tensors, and every rank
learns the figures from an object broadcast.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.dist.binding import HOST_CORES_ENV, allowed_cores, bind_rank, bound_to, machine_id
from parallel.dist.comm import TOOLING_PREFIX, CommLog, Communicator
from parallel.dist.gloo_loop import apply_gloo_loop_policy
from parallel.dist.groups import default_group_timeout, exit_process
from parallel.replay.links import LinkModel, loopback

PAYLOAD_BYTES = 8 * 2**20
SMALL_BYTES = 16 * 2**10
BURST_S = 0.5e-3          # thread CPU time of compute before each timed call: a run's calls follow compute
SMALL_REPEATS, P2P_REPEATS = 120, 120
PAYLOAD_REPEATS = (3, 8)  # the fewest and the most payload all-reduces (module docstring: "As few bytes")
PRECISION = 0.05          # their mean time is known to this share of their bytes' time when they stop
# When no two ranks share a node (every rank on its own emulated node) there is no pair to probe:
# a loopback of two ranks on the 2-core machine kind, as the planner's probe finds it
# (parallel/planner/loopback.py; latency per ring step, half a 4-byte all-reduce at 2 ranks).
FALLBACK = {"bytes_per_s": 1.3e9, "latency_s": 40e-6}
FIGURES = ("bytes_per_s", "latency_s", "p2p_latency_s")  # a probe's figures, the keys of its JSON line
TAG = TOOLING_PREFIX + "probe"  # the probe's calls in the run's log: tooling, not the strategy's
FALLBACK_L2_BYTES = 2**20  # where the OS does not tell a core's L2 (1 MiB: a server core's of recent years)


def l2_cache_bytes(core: int = 0, cpus: Path = Path("/sys/devices/system/cpu")) -> int:
    """The size of a core's L2 cache as Linux tells it (`cpus`: sysfs's cpu folder), or
    FALLBACK_L2_BYTES where it is not told (another OS, a container without sysfs)."""
    for index in sorted((cpus / f"cpu{core}" / "cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "2":
                continue
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            return int(digits) * scale
    return FALLBACK_L2_BYTES


def burst_side(l2_bytes: int) -> int:
    """The side n of the probe's burst matrix: its product a @ a reads n^2 fp32 numbers and writes
    n^2, at least twice the core's L2 cache, so that every burst leaves none of the call's own data
    there (rounded up to 32)."""
    return 32 * math.ceil(math.sqrt(l2_bytes / 4) / 32)


def burst_matrix() -> torch.Tensor:
    """The matrix of this rank's bursts, sized by the L2 of the core it runs on (bound: its own)."""
    side = burst_side(l2_cache_bytes(allowed_cores()[0]))
    return torch.ones(side, side)


def stamps_after_compute(fn, repeats: int, a: torch.Tensor, burst_s: float = BURST_S) -> list[tuple[float, float]]:
    """(post, end) of each of `repeats` calls of `fn` on this host's monotonic clock, each call
    after at least `burst_s` of this thread's CPU time spent in `a @ a` (`burst_matrix`: more
    memory than the core's L2 holds; both ranks run the same bursts, so they post together, as
    in a step)."""
    out = []
    for _ in range(repeats):
        start_cpu = time.thread_time()
        while True:
            a @ a
            if time.thread_time() - start_cpu >= burst_s:
                break
        start = time.perf_counter()
        fn()
        out.append((start, time.perf_counter()))
    return out


def pair_stamps(mine: list[tuple[float, float]], comm: Communicator) -> list[torch.Tensor]:
    """Both members' (post, end) stamps, in group-rank order. time.perf_counter is the host's
    monotonic clock (CLOCK_MONOTONIC on Linux), one clock for every process on the host, and the
    probing pair is always two ranks of one node, so the two lists compare directly."""
    stamps = torch.tensor(mine, dtype=torch.float64)
    both = torch.empty((2 * len(mine), 2), dtype=torch.float64)
    comm.all_gather_into(both, stamps, tag=f"{TAG}/stamps")
    return list(both.chunk(2))


def from_last_post(both: list[torch.Tensor], end_of: str = "mean") -> float:
    """The mean time of a call between two ranks from the later of their two posts: when the
    replay starts an op (its last member's post). A rank's own call time also holds its wait for
    the other's post, the two bursts' difference (two cores do not finish their products of an
    L2-sized matrix at the same moment), which the replay does not charge to the link. `end_of`:
    "mean", the two ranks' ends averaged (a collective ends for both at once, give or take the last
    chunk); "first", the first member's end (a ping-pong's round trip ends when the first member
    has the reply)."""
    return float(call_times(both, end_of).mean())


def call_times(both: list[torch.Tensor], end_of: str = "mean") -> torch.Tensor:
    """Each call's time from the later of the two posts (`from_last_post`)."""
    a, b = both
    last_post = torch.maximum(a[:, 0], b[:, 0])
    end = (a[:, 1] + b[:, 1]) / 2 if end_of == "mean" else a[:, 1]
    return end - last_post


def pair_calls(comm: Communicator) -> list[list[torch.Tensor]]:
    """Both members' (post, end) stamps of the probe's three kinds of call between the two ranks
    of `comm` (a group of two; both call it), each after a burst: SMALL_BYTES all-reduces,
    PAYLOAD_BYTES all-reduces (`payload_calls`), SMALL_BYTES ping-pongs (one message each way:
    the first member sends, then receives). Every call goes through `comm`, so its log holds them
    under TAG."""
    big, small = torch.ones(PAYLOAD_BYTES // 4), torch.ones(SMALL_BYTES // 4)
    comm.all_reduce(big, tag=f"{TAG}/warm")  # warm: buffers of the payload's size allocated
    comm.all_reduce(small, tag=f"{TAG}/warm")
    peer, first = 1 - comm.rank, comm.rank == 0

    def ping_pong():
        if first:
            comm.send(small, peer, tag=f"{TAG}/ping_pong")
            comm.recv(small, peer, tag=f"{TAG}/ping_pong")
        else:
            comm.recv(small, peer, tag=f"{TAG}/ping_pong")
            comm.send(small, peer, tag=f"{TAG}/ping_pong")

    ping_pong()
    burst = burst_matrix()
    # Each kind's stamps gathered after its calls, so that no gather runs between a burst and its call.
    small_calls = stamps_after_compute(lambda: comm.all_reduce(small, tag=f"{TAG}/small"), SMALL_REPEATS, burst)
    small_both = pair_stamps(small_calls, comm)
    big_both = payload_calls(comm, big, burst, call_times(small_both))
    return [small_both, big_both, pair_stamps(stamps_after_compute(ping_pong, P2P_REPEATS, burst), comm)]


def payload_calls(comm: Communicator, big: torch.Tensor, burst: torch.Tensor,
                  small: torch.Tensor) -> list[torch.Tensor]:
    """Both members' (post, end) stamps of the PAYLOAD_BYTES all-reduces, each after a burst: the
    two exchange each call's stamps after its end (before the next burst), and both judge from the
    same figures whether their mean is known well enough (`known_well_enough`; `small`: the small
    calls' times), at the fewest of PAYLOAD_REPEATS calls and after each one more, up to the most."""
    fewest, most = PAYLOAD_REPEATS
    both = [torch.empty((0, 2), dtype=torch.float64)] * 2
    while len(both[0]) < most:
        latest = pair_stamps(stamps_after_compute(lambda: comm.all_reduce(big, tag=f"{TAG}/payload"), 1, burst), comm)
        both = [torch.cat([mine, new]) for mine, new in zip(both, latest)]
        if len(both[0]) >= fewest and known_well_enough(call_times(both), small):
            break
    return both


def known_well_enough(times: torch.Tensor, small: torch.Tensor, precision: float = PRECISION) -> bool:
    """Whether the standard error of the mean of `times` (payload calls, from the later post) is
    at most `precision` of their bytes' time, their mean less the small calls' (`small`). A payload
    call makes a small one's handoffs and more, so its spread is taken as at least theirs, which
    many calls measure well: the spread of a few calls can read low by chance."""
    bytes_time = float(times.mean() - small.mean())
    spread = max(float(times.std()), float(small.std()))
    return bytes_time > 0 and spread / math.sqrt(len(times)) <= precision * bytes_time


def solve(t_small: float, t_big: float, t_pp: float) -> tuple[float, float, float]:
    """(bytes_per_s, latency_s per ring step, p2p latency_s per message) from the mean times of
    the three kinds of call: t = 2 L + S / rate for each all-reduce (n = 2: each rank sends S),
    the two solved together; a ping-pong is two messages."""
    rate = (PAYLOAD_BYTES - SMALL_BYTES) / max(t_big - t_small, 1e-9)
    latency = max((t_small - SMALL_BYTES / rate) / 2, 1e-6)
    p2p = max(t_pp / 2 - SMALL_BYTES / rate, 1e-6)
    return rate, latency, p2p


def measure_pair(comm: Communicator) -> tuple[float, float, float]:
    """(bytes_per_s, latency_s per ring step, p2p latency_s per message) between the two ranks of
    `comm` (both call it): each call timed from the later of the two posts (`from_last_post`);
    a ping-pong's round trip to the first member's reply, two messages, each completing at the
    later of its two posts plus its transfer, as the replay has it."""
    small, big, pp = pair_calls(comm)
    return solve(from_last_post(small), from_last_post(big), from_last_post(pp, end_of="first"))


def given_figures(virtual) -> dict | None:
    """The loopback figures a config's `virtual` block gives, in `measure_once`'s keys and units
    (p2p_latency_s None where only the first two are given: a message then costs a ring step), or
    None where it does not give both the rate and the latency."""
    if not virtual.get("loopback_gbytes_per_s") or virtual.get("loopback_latency_us") is None:
        return None
    p2p = virtual.get("loopback_p2p_latency_us")
    return {"bytes_per_s": float(virtual["loopback_gbytes_per_s"]) * 1e9,
            "latency_s": float(virtual["loopback_latency_us"]) * 1e-6,
            "p2p_latency_s": float(p2p) * 1e-6 if p2p is not None else None}


def link_of(figures: dict, source: str) -> LinkModel:
    """The loopback link model of a probe's figures (`measure_once`'s keys; a missing message
    latency: a message costs a ring step)."""
    return loopback(figures["bytes_per_s"], figures["latency_s"], source, figures.get("p2p_latency_s"))


def figure_overrides(figures: dict) -> list[str]:
    """The `virtual.loopback_*` overrides that give a run `figures` (`measure_once`'s keys), as a
    sweep gives its one probe to every run."""
    out = [f"virtual.loopback_gbytes_per_s={figures['bytes_per_s'] / 1e9}",
           f"virtual.loopback_latency_us={figures['latency_s'] * 1e6}"]
    if figures.get("p2p_latency_s") is not None:
        out.append(f"virtual.loopback_p2p_latency_us={figures['p2p_latency_s'] * 1e6}")
    return out


def probe_loopback(world: Communicator | None, node_of, given: dict | None = None,
                   gloo_loop_policy: str = "batch") -> LinkModel:
    """Every rank calls this with the run's world (a pair group is made, with the run's timeout,
    its gloo event loop set as the run's: `train.gloo_loop_policy`); every rank gets the model
    (rank 0's figures). Its calls reach `world`'s log under TAG."""
    figures = given_figures(given or {})
    if figures is not None:
        named = "virtual.loopback_gbytes_per_s, virtual.loopback_latency_us" + (
            ", virtual.loopback_p2p_latency_us" if figures["p2p_latency_s"] is not None else "")
        return link_of(figures, f"given ({named})")
    partner = next((r for r in range(1, world.size) if node_of(r) == node_of(0)), None) if world else None
    if partner is None:
        return loopback(FALLBACK["bytes_per_s"], FALLBACK["latency_s"],
                        "this machine's planner figures (no two ranks on one node to probe with)")
    pair = dist.new_group([0, partner], backend="gloo", timeout=default_group_timeout())
    apply_gloo_loop_policy(gloo_loop_policy)
    measured = None
    if world.rank in (0, partner):
        with bound_to(pair_cores(world.rank == 0)):
            measured = measure_pair(Communicator("probe", pair, world.log))
    rate, latency, p2p = world.broadcast_object(measured, 0, tag=f"{TAG}/figures")
    dist.destroy_process_group(pair)
    return loopback(rate, latency,
                    f"probed in this run: ranks 0 and {partner}, each bound to a core of its own, mean of "
                    f"{SMALL_BYTES // 1024} KiB and {PAYLOAD_BYTES // 2**20} MiB all-reduces and of "
                    f"{SMALL_BYTES // 1024} KiB ping-pongs after compute", p2p)


def pair_cores(first: bool) -> list[int] | None:
    """The core one rank of the probing pair takes while it measures, or None where it is already
    on a core of its own (a run bound by `train.pin_cores`) or the machine has a single core: in a
    run with more ranks than cores the pair still measures with a core each (the others wait for the
    figures), as the virtual clock assumes and as a bound run has it (parallel/dist/binding.py)."""
    allowed = allowed_cores()
    if os.environ.get(HOST_CORES_ENV) or len(allowed) < 2:
        return None
    return [allowed[0] if first else allowed[1]]


def run_probe(module: str, ranks: int, timeout_s: float, gloo_loop_policy: str = "batch",
              pin_cores: str | None = None) -> dict:
    """Run a probe `module` under torchrun with `ranks` gloo ranks of their own and read the JSON
    line its rank 0 prints (this one; the planner's parallel/planner/loopback.py). Its gloo event
    loop is set as a run's would be (`train.gloo_loop_policy`, its first argument); `pin_cores`
    (this module's second argument) binds its ranks or not as `train.pin_cores` would."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", module,
           gloo_loop_policy, *([pin_cores] if pin_cores else [])]
    root = str(Path(__file__).resolve().parents[2])  # this checkout's code, in the child processes too
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probing loopback with {ranks} gloo ranks ({module}) failed: {proc.stderr[-500:]}")
    return json.loads(lines[-1])


def measure_once(runs: int = 3, timeout_s: float = 120, gloo_loop_policy: str = "batch",
                 pin_cores: str = "auto") -> dict:
    """{"bytes_per_s", "latency_s", "p2p_latency_s"}: this module's probe run by two ranks of their own (one per core),
    for a sweep that gives one figure to all its runs (`virtual.loopback_*`), so that they differ only
    in what they measured, not in their probes.

    Each figure is the median of `runs` probe runs: one probe run's figures move from run to run
    with the host's moment, not with the number of calls (a longer run spreads as widely), and every
    run of a sweep inherits its probe's error in one direction.

    `pin_cores=off` probes with the two ranks' threads left where the kernel puts them, as in a
    run with more ranks than cores (bench/virtual_time prints the contention replays on it beside
    its check, which uses the runs' own bound figures): each handoff of a call then may wake its
    thread on the other core."""
    probes = [run_probe("parallel.replay.probe", 2, timeout_s, gloo_loop_policy, pin_cores)
              for _ in range(max(1, runs))]
    return median_figures(probes)


def median_figures(probes: list[dict]) -> dict:
    """Each of a probe's figures (FIGURES), the median over `probes` (probe runs' JSON lines)."""
    return {key: statistics.median(p[key] for p in probes) for key in FIGURES}


def main() -> None:
    """Under torchrun with 2 ranks: print {"bytes_per_s", "latency_s", "p2p_latency_s"} as JSON on rank 0.
    Its optional arguments: `train.gloo_loop_policy` (default batch), then `train.pin_cores`
    (default auto: each rank on a core of its own, as a bound run's ranks are; off: not bound)."""
    policy = sys.argv[1] if len(sys.argv) > 1 else "batch"
    pin = sys.argv[2] if len(sys.argv) > 2 else "auto"
    dist.init_process_group("gloo")
    apply_gloo_loop_policy(policy)
    torch.set_num_threads(1)
    bind_rank(pin, [machine_id()] * dist.get_world_size(), dist.get_rank(), 1, "cpu")
    rate, latency, p2p = measure_pair(Communicator("world", dist.group.WORLD, CommLog()))
    if dist.get_rank() == 0:
        print(json.dumps({"bytes_per_s": rate, "latency_s": latency, "p2p_latency_s": p2p}))
    dist.destroy_process_group()
    exit_process(0)  # past gloo's finalisation abort (parallel/dist/groups.py): the JSON line is out


if __name__ == "__main__":
    main()
