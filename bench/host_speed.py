"""How fast this host runs the same work from one moment to the next: the floor under any CPU-timed figure.

    python bench/host_speed.py [windows=30] [steps=30] [gap_s=5] [repeats=3] [batch=4] [reference=0] [beside=0]

One process, one intra-op thread, nothing else of ours running: `windows` times, the tiny model's
forward and backward on a fixed batch of `batch` sequences (a world-4 rank's share of the default
global batch), `steps` steps in a row, `gap_s` seconds of sleep between windows (a run's start-up
separates two runs of the stability check by about that much). Each step is timed on the thread's
CPU clock (`time.thread_time`, the clock the virtual time is built on) and on the wall clock; a
window's figure is the lower median of its steps, as a run's step time is.

Printed: the windows' figures (median, range, the largest deviation from the median), and the same
statistic the stability check (bench/virtual_time.py) applies to a strategy's three repeats,
applied to every `repeats` consecutive windows: how often the same work, on one thread, with no
contention from other ranks, already stays within ±5% of its median. Where this host's own speed
moves by more, no CPU-timed figure can stay within it.

Why the CPU clock moves at all: on a virtual machine the thread's CPU time counts time on the vCPU,
and the vCPU runs slower when its physical core's caches and memory bandwidth are busy with other
guests' work, or at a lower frequency. Nothing inside the guest sees it (the hypervisor's steal
time counts only time the vCPU did not run; hardware cycle and instruction counters are not
exposed on this machine kind: `perf stat -e instructions true` reads "not supported").
bench/virtual_time.py times one such window before each of its runs and prints, beside the
stability check, how far the host alone moved over the same repeats.

With `reference=1` every model step is followed, in the same thread, by two reference kernels: a
compute-bound one (four 256x256 fp32 matmuls) and a pure-Python loop (20000 integer additions, the
interpreter alone). If the host slowed every kind of work alike, the model's step divided by a
reference would hold still while each moved, and a run's CPU times could be put on a steady scale
by timing a reference beside them. The printed spreads of those two ratios say whether it does.

With `beside=1` a second process, bound to another core (this one bound to the first), times the
same windows at the same moments (both start each window together). If the host slowed both
cores alike, a probe process running beside a run would carry the run's moment, and the run's CPU
times could be divided by it; the printed spread of the two processes' ratio says whether it does.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parallel.core.model import GPT, GPTConfig, token_loss_sum  # noqa: E402


def lower_median(xs: list[float]) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


class Workload:
    """The fixed work: the tiny model's forward and backward on `batch` sequences, on one thread.
    bench/virtual_time.py times one window of it before each of its runs."""

    def __init__(self, batch: int = 4):
        torch.set_num_threads(1)
        cfg = GPTConfig()
        self.model = GPT(cfg)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        self.idx, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.window(5)  # warm-up: the allocator and the kernels

    def window(self, steps: int) -> tuple[float, float]:
        """The lower median of `steps` forward+backward steps, on the thread's CPU clock and the wall clock."""
        cpu, wall = [], []
        for _ in range(steps):
            c0, w0 = time.thread_time(), time.perf_counter()
            token_loss_sum(self.model(self.idx), self.targets).backward()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
        return lower_median(cpu), lower_median(wall)


class Reference:
    """Two fixed kernels of other kinds than the model's step, timed on the thread's CPU clock."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(256, 256, generator=gen)
        self.b = torch.randn(256, 256, generator=gen)

    def matmul(self) -> float:
        c0 = time.thread_time()
        for _ in range(4):
            torch.mm(self.a, self.b)
        return time.thread_time() - c0

    @staticmethod
    def python_loop() -> float:
        c0 = time.thread_time()
        total = 0
        for i in range(20000):
            total += i
        return time.thread_time() - c0


def interleaved_window(work: Workload, ref: Reference, steps: int) -> tuple[float, float, float]:
    """`steps` rounds of one model step, one matmul kernel, one Python loop: each one's lower median
    (CPU seconds), so that the three sample the same moments of the host."""
    model, mm, py = [], [], []
    for _ in range(steps):
        c0 = time.thread_time()
        token_loss_sum(work.model(work.idx), work.targets).backward()
        model.append(time.thread_time() - c0)
        mm.append(ref.matmul())
        py.append(ref.python_loop())
    return lower_median(model), lower_median(mm), lower_median(py)


def beside_worker(core: int, batch: int, windows: int, steps: int, barrier, results) -> None:
    """The second process of `beside=1`: the same windows, each started with the first process's."""
    os.sched_setaffinity(0, {core})
    work = Workload(batch)
    for _ in range(windows):
        barrier.wait()
        results.put(work.window(steps)[0])


def max_dev(xs: list[float]) -> float:
    m = statistics.median(xs)
    return max(abs(x / m - 1) for x in xs)


def main(argv: list[str]) -> None:
    opts = {"windows": "30", "steps": "30", "gap_s": "5", "repeats": "3", "batch": "4", "reference": "0",
            "beside": "0"}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in opts:
            sys.exit(f"host_speed: unknown option {key!r} (options: {', '.join(opts)})")
        opts[key] = value
    for key in ("reference", "beside"):
        if opts[key] not in ("0", "1"):
            sys.exit(f"host_speed: {key}={opts[key]!r}: give 0 or 1")
    if opts["reference"] == "1" and opts["beside"] == "1":
        sys.exit("host_speed: reference=1 and beside=1 are two experiments: give one")
    cores = sorted(os.sched_getaffinity(0))
    if opts["beside"] == "1" and len(cores) < 2:
        sys.exit(f"host_speed: beside=1 needs two usable cores, this process has {len(cores)}")
    windows, steps = int(opts["windows"]), int(opts["steps"])
    work = Workload(int(opts["batch"]))
    ref = Reference() if opts["reference"] == "1" else None
    other, barrier, results, beside = None, None, None, []
    if opts["beside"] == "1":
        os.sched_setaffinity(0, {cores[0]})
        spawn = multiprocessing.get_context("spawn")
        barrier, results = spawn.Barrier(2), spawn.Queue()
        other = spawn.Process(target=beside_worker, args=(cores[1], int(opts["batch"]), windows, steps, barrier,
                                                           results), daemon=True)
        other.start()
    cpu, wall, mm, py = [], [], [], []
    for k in range(windows):
        if k:
            time.sleep(float(opts["gap_s"]))
        if other is not None:
            barrier.wait(timeout=300)
            c, _ = work.window(steps)
            b = results.get(timeout=300)
            cpu.append(c)
            beside.append(b)
            print(f"window {k:2d}: CPU {c * 1e3:6.2f} ms  beside {b * 1e3:6.2f} ms  ratio {c / b:5.2f}", flush=True)
        elif ref is None:
            c, w = work.window(steps)
            cpu.append(c)
            wall.append(w)
            print(f"window {k:2d}: CPU {c * 1e3:6.2f} ms  wall {w * 1e3:6.2f} ms", flush=True)
        else:
            c, m, p = interleaved_window(work, ref, steps)
            cpu.append(c)
            mm.append(m)
            py.append(p)
            print(f"window {k:2d}: model {c * 1e3:6.2f} ms  matmul {m * 1e3:6.3f} ms  Python loop {p * 1e3:6.3f} ms"
                  f"  model/matmul {c / m:5.2f}  model/Python {c / p:5.2f}", flush=True)
    if other is not None:
        other.join(timeout=60)
    r = int(opts["repeats"])
    print(f"\n{len(cpu)} windows of {opts['steps']} steps, {opts['gap_s']} s apart, one thread (ms a step):")
    series = ([("model", cpu), ("matmul", mm), ("Python loop", py)] if ref is not None
              else [("CPU", cpu), ("beside", beside)] if beside else [("CPU", cpu), ("wall", wall)])
    for name, xs in series:
        m = statistics.median(xs)
        print(f"  {name:4s} median {m * 1e3:.2f}, range {min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}, "
              f"max dev. from median ±{max_dev(xs):.1%}")
    if ref is not None:
        for name, den in (("matmul", mm), ("Python loop", py)):
            ratio = [c / d for c, d in zip(cpu, den)]
            print(f"  model / {name}: median {statistics.median(ratio):.2f}, "
                  f"range {min(ratio):.2f}-{max(ratio):.2f}, max dev. from median ±{max_dev(ratio):.1%} "
                  "(to put runs on a steady scale it would have to hold within ±5%)")
    if beside:
        ratio = [c / b for c, b in zip(cpu, beside)]
        print(f"  this core / the other: median {statistics.median(ratio):.2f}, "
              f"range {min(ratio):.2f}-{max(ratio):.2f}, max dev. from median ±{max_dev(ratio):.1%} "
              "(for a probe beside a run to carry the run's moment it would have to hold within ±5%)")
    groups = [cpu[i:i + r] for i in range(len(cpu) - r + 1)]
    devs = sorted(max_dev(g) for g in groups)
    within = sum(d <= 0.05 for d in devs)
    print(f"  every {r} consecutive windows on the CPU clock (the stability check's statistic): "
          f"{within} of {len(groups)} within ±5%; max dev. median ±{statistics.median(devs):.1%}, "
          f"worst ±{devs[-1]:.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
