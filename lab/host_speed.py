"""How fast this host runs the same work from one moment to the next: the floor under any CPU-timed figure.

    python -m lab.host_speed [windows=30] [steps=30] [gap_s=5] [repeats=3] [batch=4] [reference=0] [beside=0]

One process, one intra-op thread, nothing else of ours running: `windows` times, the tiny model's
forward and backward on a fixed batch of `batch` sequences (a world-4 rank's share of the default
global batch), `steps` steps in a row, `gap_s` seconds of sleep between windows (about what a run's
start-up puts between two runs made one after another). Each step is timed on the thread's
CPU clock (`time.thread_time`, the clock the virtual time is built on) and on the wall clock; a
window's figure is the lower median of its steps, as a run's step time is.

Printed: the windows' figures (median, range, the largest deviation from the median), and the same
statistic the virtual-time validation's stability check applies to a strategy's repeats,
applied to every `repeats` consecutive windows: how often the same work, on one thread, with no
contention from other ranks, already stays within ±5% of its median. Where this host's own speed
moves by more, no CPU-timed figure can stay within it.

Why the CPU clock moves at all: on a virtual machine the thread's CPU time counts time on the vCPU,
and the vCPU runs slower when its physical core's caches and memory bandwidth are busy with other
guests' work, or at a lower frequency. Nothing inside the guest sees it (the hypervisor's steal
time counts only time the vCPU did not run; hardware cycle and instruction counters are not
exposed on a guest of this kind: `perf stat -e instructions true` says whether they are).

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

import torch

from bench.harness import lower_median, max_dev
from parallel.core.model import GPT, GPTConfig, token_loss_sum

OPTIONS = {"windows": "30", "steps": "30", "gap_s": "5", "repeats": "3", "batch": "4", "reference": "0", "beside": "0"}


class Workload:
    """The fixed work: the tiny model's forward and backward on `batch` sequences, on one thread."""

    def __init__(self, batch: int = 4):
        torch.set_num_threads(1)
        cfg = GPTConfig()
        self.model = GPT(cfg)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        self.idx, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.window(5)  # warm-up: the allocator and the kernels

    def step(self) -> None:
        token_loss_sum(self.model(self.idx), self.targets).backward()

    def window(self, steps: int) -> tuple[float, float]:
        """The lower median of `steps` forward+backward steps, on the thread's CPU clock and the wall clock."""
        cpu, wall = [], []
        for _ in range(steps):
            c0, w0 = time.thread_time(), time.perf_counter()
            self.step()
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
        work.step()
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


class Beside:
    """`beside=1`: this process bound to the first core, a second one on the other, their windows
    started together."""

    def __init__(self, cores: list[int], batch: int, windows: int, steps: int):
        os.sched_setaffinity(0, {cores[0]})
        spawn = multiprocessing.get_context("spawn")
        self.barrier, self.results = spawn.Barrier(2), spawn.Queue()
        self.other = spawn.Process(target=beside_worker, args=(cores[1], batch, windows, steps, self.barrier,
                                                               self.results), daemon=True)
        self.other.start()

    def window(self, work: Workload, steps: int) -> tuple[float, float]:
        """This process's window and the other's, started together (CPU seconds)."""
        self.barrier.wait(timeout=300)
        mine = work.window(steps)[0]
        return mine, self.results.get(timeout=300)


def options(argv: list[str]) -> dict[str, str]:
    opts = dict(OPTIONS)
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
    if opts["beside"] == "1" and len(os.sched_getaffinity(0)) < 2:
        sys.exit(f"host_speed: beside=1 needs two usable cores, this process has {len(os.sched_getaffinity(0))}")
    return opts


def window_line(k: int, figures: dict[str, float]) -> str:
    """One window's figures (ms a step), and the ratio its experiment is about."""
    line = f"window {k:2d}: " + "  ".join(f"{name} {x * 1e3:6.3f} ms" for name, x in figures.items())
    return line + "".join(f"  {name} {x:5.2f}" for name, (x,) in ratios({n: [x] for n, x in figures.items()}).items())


def sample(opts: dict[str, str]) -> dict[str, list[float]]:
    """Every window's figures, one series per name, printed as they come."""
    windows, steps, batch = int(opts["windows"]), int(opts["steps"]), int(opts["batch"])
    work = Workload(batch)
    ref = Reference() if opts["reference"] == "1" else None
    beside = Beside(sorted(os.sched_getaffinity(0)), batch, windows, steps) if opts["beside"] == "1" else None
    names = ("model", "matmul", "Python loop") if ref else ("CPU", "beside") if beside else ("CPU", "wall")
    series: dict[str, list[float]] = {name: [] for name in names}
    for k in range(windows):
        if k:
            time.sleep(float(opts["gap_s"]))
        if ref:
            figures = interleaved_window(work, ref, steps)
        else:
            figures = beside.window(work, steps) if beside else work.window(steps)
        for name, x in zip(names, figures):
            series[name].append(x)
        print(window_line(k, dict(zip(names, figures))), flush=True)
    if beside:
        beside.other.join(timeout=60)
    return series


def ratios(series: dict[str, list[float]]) -> dict[str, list[float]]:
    """What an experiment is about: the model's step over each reference kernel's (`reference=1`),
    or this core's window over the other's (`beside=1`)."""
    if "model" in series:
        return {f"model/{name}": [a / b for a, b in zip(series["model"], series[name])]
                for name in ("matmul", "Python loop")}
    if "beside" in series:
        return {"ratio": [a / b for a, b in zip(series["CPU"], series["beside"])]}
    return {}


def spread(xs: list[float], scale: float = 1.0) -> str:
    return (f"median {statistics.median(xs) * scale:.2f}, range {min(xs) * scale:.2f}-{max(xs) * scale:.2f}, "
            f"max dev. from median ±{max_dev(xs):.1%}")


def summarize(series: dict[str, list[float]], opts: dict[str, str]) -> None:
    print(f"\n{opts['windows']} windows of {opts['steps']} steps, {opts['gap_s']} s apart, one thread (ms a step):")
    for name, xs in series.items():
        print(f"  {name:4s} {spread(xs, 1e3)}")
    for name, xs in ratios(series).items():
        if name == "ratio":
            print(f"  this core / the other: {spread(xs)} (for a probe beside a run to carry the run's moment it "
                  "would have to hold within ±5%)")
        else:
            print(f"  {name.replace('/', ' / ')}: {spread(xs)} (to put runs on a steady scale it would have to "
                  "hold within ±5%)")
    cpu, r = next(iter(series.values())), int(opts["repeats"])
    devs = sorted(max_dev(cpu[i:i + r]) for i in range(len(cpu) - r + 1))
    within = sum(d <= 0.05 for d in devs)
    print(f"  every {r} consecutive windows on the CPU clock (the stability check's statistic): "
          f"{within} of {len(devs)} within ±5%; max dev. median ±{statistics.median(devs):.1%}, "
          f"worst ±{devs[-1]:.1%}")


def main(argv: list[str]) -> None:
    opts = options(argv)
    summarize(sample(opts), opts)


if __name__ == "__main__":
    main(sys.argv[1:])
