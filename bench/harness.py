"""What every benchmark in bench/ shares: the plan, the variants taking turns, the clock, the statistics, the runs.

Two kinds of benchmark use it.

A head-to-head runs under torchrun (`torchrun --standalone --nproc-per-node N -m bench.<name>`)
with Hydra-style overrides of the training config plus a few options of its own (`rounds=N
steps=N ...`). It builds a validated plan exactly as `launch.train` does (`plan_for`), creates the
process groups (`run_distributed`), and lets its variants, ours and PyTorch's on the same model,
take turns in the same processes (`alternate`): round-robin with a rotating start, so that
machine noise and drift fall on all of them alike. Every step is timed on one clock (`CLOCK`),
and the report gives each variant's median, its interval and the ratio against PyTorch's
(`Timings`, `print_timings`, `print_ratio`).

A benchmark that launches whole runs (the virtual-time validation, the network table) starts each
as a child process through parallel/runner.py, the project's one supervisor of a run, and reads
its summary.json back (`train_command`, `net_command`, `run`, `start`, `finish`).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from launch.config import CODE_ROOT, CONFIG_DIR
from parallel import runner
from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.host_memory import apply_host_allocator
from parallel.dist.binding import threads_per_rank
from parallel.dist.comm import CommLog
from parallel.dist.gloo_loop import apply_gloo_loop_policy
from parallel.dist.groups import LaunchEnv, exit_process, exit_with_error, init_distributed, shutdown
from parallel.run_plan import build_plan

CONF = Path(CONFIG_DIR)
CLOCK = "the wall clock (time.perf_counter); a step lasts as long as its slowest rank"
RUN_TIMEOUT_S = 900  # one run of a launching benchmark: far beyond any run it makes


# -- arguments, plan, process groups --------------------------------------------------------------------
def split_args(argv: list[str], options: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """`key=value` arguments named in `options` (defaults) are the benchmark's; the rest are
    overrides of the training config."""
    values, overrides = dict(options), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in values:
            values[key] = value
        else:
            overrides.append(arg)
    return overrides, values


def options(argv: list[str], defaults: dict[str, str]) -> dict[str, str]:
    """`key=value` arguments, each one of `defaults`' keys: an unknown one is refused by name."""
    values = dict(defaults)
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in values:
            raise SystemExit(f"unknown option {key!r}: {', '.join(values)}")
        values[key] = value
    return values


def plan_for(env: LaunchEnv, defaults: list[str], overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*defaults, *overrides])
    return build_plan(cfg, env, cuda_available=torch.cuda.is_available())


def run_distributed(env: LaunchEnv, plan, body) -> None:
    """Set threads, load the corpus, create the groups, run `body(plan, ctx, corpus)`, tear down, exit."""
    torch.set_num_threads(threads_per_rank(env.local_world_size, plan.threads))
    apply_host_allocator(plan.host_allocator)  # as launch.train does: ours and PyTorch's alike
    corpus = load_corpus(plan.data_path, plan.data_max_bytes, plan.model.seq_len + 1)
    ctx = init_distributed(env, plan.dims, plan.backend, plan.timeout_s, CommLog())
    ctx.gloo_loop_policy = plan.gloo_loop_policy  # as launch.train sets it: timed_step applies it before each step
    try:
        body(plan, ctx, corpus)
    finally:
        shutdown(ctx)
    exit_process(0)


def refuse(env: LaunchEnv, message: str) -> None:
    """A benchmark that cannot run this layout: one line, exit 2, before any process group."""
    exit_with_error(env, message)


class Steps:
    """The global batches every variant walks, and this rank's microbatches of each."""

    def __init__(self, plan, ctx, corpus):
        self.plan, self.ctx = plan, ctx
        self.batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)

    def __call__(self, k: int, microbatches: int | None = None) -> tuple[list[torch.Tensor], int]:
        """Step k's microbatches on this rank (`microbatches`: another count than the plan's) and the
        global batch's token count."""
        glob, dims = self.batches(k), self.plan.dims
        m = microbatches or self.plan.microbatches
        return ([mb.to(self.ctx.device) for mb in local_microbatches(glob, self.ctx.coords["dp"], dims.dp, m)],
                glob.n_tokens)

    def of(self, strategy, k: int, microbatches: int | None = None):
        """One training step of `strategy` on step k's batch, as a callable."""
        return partial(strategy.train_step, *self(k, microbatches))


# -- the variants taking turns, on one clock ---------------------------------------------------------------
def rotation(names: list[str], round_index: int) -> list[str]:
    """The variants' order in one round: the start rotates, so no variant always runs right after
    the same other one (caches, allocator state and machine drift fall on all alike)."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def timed_step(ctx, step_fn):
    """Run one training step as one step of the communication log.

    Returns (seconds of the slowest rank on rank 0, None elsewhere; what step_fn returned; this
    rank's traffic of the step).
    """
    if ctx.gloo_loop_policy is not None:  # groups the variants made since (dist/gloo_loop.py), before the clock
        apply_gloo_loop_policy(ctx.gloo_loop_policy)
    ctx.log.begin_step()
    start = time.perf_counter()
    result = step_fn()
    elapsed = time.perf_counter() - start
    traffic = ctx.log.end_step()
    per_rank = ctx.comm("world").gather_object(elapsed, 0, tag="tooling/bench")
    return (max(per_rank) if per_rank is not None else None), result, traffic


@dataclass(frozen=True)
class Ratio:
    """Ours against theirs in tokens/s (theirs' step over ours): over every timed step's median, and
    its lowest and highest round by round."""

    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.3f} (rounds {self.low:.3f}-{self.high:.3f})"


class Timings:
    """Each variant's timed steps in order, `steps` a round, on CLOCK (filled on rank 0).

    A variant's figure is the median of its timed steps; its interval the lowest and highest of its
    rounds' medians: how far one round, seconds from the others in the same processes, strays."""

    def __init__(self, names: list[str], steps: int):
        self.steps = steps
        self.seconds: dict[str, list[float]] = {name: [] for name in names}

    def measured(self) -> list[str]:
        return [name for name, s in self.seconds.items() if s]

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def rounds(self, name: str) -> list[float]:
        s, n = self.seconds[name], self.steps
        return [statistics.median(s[i:i + n]) for i in range(0, len(s) - n + 1, n)]

    def interval(self, name: str) -> tuple[float, float]:
        rounds = self.rounds(name)
        return min(rounds), max(rounds)

    def ratio(self, ours: str, theirs: str) -> Ratio:
        by_round = [t / o for o, t in zip(self.rounds(ours), self.rounds(theirs))]
        return Ratio(self.median(theirs) / self.median(ours), min(by_round), max(by_round))


def alternate(ctx, variants: dict, batch: Steps, rounds: int, steps: int, microbatches: dict[str, int] | None = None,
              after=None, profiles=None, first_step: int = 0) -> tuple[Timings, dict]:
    """The variants (name -> strategy) in turn, `steps` steps each per round, for `rounds` timed
    rounds after round 0, which warms every variant up and is not timed.

    Each variant walks its own step counter from `first_step` through `batch`, so all see the same
    batches in the same order (`microbatches`: a variant's own count). `after(name, result)` runs
    on every rank after each step, outside the clock; `profiles` (Profiles) wraps the timed steps.
    Returns the timings (rank 0's) and each variant's traffic of its last step on this rank."""
    names = list(variants)
    timings, traffic = Timings(names, steps), {}
    counter = dict.fromkeys(names, first_step)
    for r in range(rounds + 1):
        for name in rotation(names, r):
            for _ in range(steps):
                step = batch.of(variants[name], counter[name], (microbatches or {}).get(name))
                counter[name] += 1
                if r > 0 and profiles is not None:
                    step = partial(profiles.around, name, step)
                seconds, result, traffic[name] = timed_step(ctx, step)
                if after is not None:
                    after(name, result)
                if r > 0 and ctx.is_rank0:
                    timings.seconds[name].append(seconds)
    return timings, traffic


def timing_note(rounds: int, steps: int) -> str:
    """What the printed figures are, for a report's heading."""
    return (f"{rounds} rounds x {steps} steps per variant after a warm-up round | clock: {CLOCK} | "
            "figures: medians of the timed steps, intervals: the lowest and highest round's median")


def print_timings(timings: Timings, tokens_per_step: int, width: int = 12) -> None:
    print(f"{'variant':<{width}} {'step ms':>9} {'rounds ms':>15} {'tokens/s':>10}")
    for name in timings.measured():
        seconds, (low, high) = timings.median(name), timings.interval(name)
        print(f"{name:<{width}} {seconds * 1e3:9.1f} {f'{low * 1e3:.1f}-{high * 1e3:.1f}':>15} "
              f"{tokens_per_step / seconds:10.0f}")


def print_ratio(timings: Timings, ours: str, theirs: str) -> None:
    print(f"{ours} / {theirs} tokens/s: {timings.ratio(ours, theirs)}  (>1: {ours} is faster)")


def lower_median(xs: list[float]) -> float:
    """One real value (with an even count, the lower of the middle two), as a run's step time is."""
    return sorted(xs)[(len(xs) - 1) // 2]


def max_dev(xs: list[float]) -> float:
    """The largest deviation from the median, as a share of it."""
    m = statistics.median(xs)
    return max(abs(x / m - 1) for x in xs)


class Profiles:
    """One cProfile per variant, switched on around its timed steps (rank 0's Python: where a step's
    time goes function by function, for the benchmarks' `profile=1`)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.by_name: dict[str, cProfile.Profile] = {}

    def around(self, name: str, fn):
        if not self.enabled:
            return fn()
        prof = self.by_name.setdefault(name, cProfile.Profile())
        prof.enable()
        try:
            return fn()
        finally:
            prof.disable()

    def report(self, top: int = 15) -> None:
        for name, prof in self.by_name.items():
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
            lines = [line for line in out.getvalue().splitlines() if line.strip()]
            start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
            total = next((line for line in lines if "function calls" in line), "")
            print(f"\nprofile of {name} (rank 0, its timed steps; by own time): {total.strip()}")
            print("\n".join(lines[start:start + top + 1]))


# -- whole runs as child processes, through parallel/runner.py ------------------------------------------
class RunFailed(Exception):
    """A run that ended without a summary; the message is the run's own verdict."""


def train_command(world: int, overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "launch.train", *overrides, f"run.dir={run_dir}"]


def net_command(overrides: list[str], run_dir: Path) -> list[str]:
    """A run on an emulated network (launch.run: needs root)."""
    return [sys.executable, "-m", "launch.run", *overrides, f"run.dir={run_dir}"]


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it in the project's folder."""
    return " ".join(["python", *cmd[1:]]).replace(str(CODE_ROOT) + "/", "")


def start(cmd: list[str], run_dir: Path):
    """A run started and left in flight (runner.start); `finish` waits for it."""
    return runner.start(cmd, run_dir)


def finish(proc, run_dir: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """The summary of a run started by `start`; RunFailed with its verdict if it has none."""
    status, error = runner.finish(proc, run_dir, timeout_s)
    if status != "ok":
        raise RunFailed(f"{run_dir.name}: {error}")
    return json.loads((run_dir / "summary.json").read_text())


def run(cmd: list[str], run_dir: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """One run from start to end; its summary."""
    return finish(start(cmd, run_dir), run_dir, timeout_s)
