"""What every benchmark in bench/ shares: its arguments, the plan, the process groups, the exit.

A benchmark is run under torchrun with Hydra-style overrides of the training config plus a few
options of its own (`rounds=N steps=N ...`); it builds a validated plan exactly as
`launch.train` does, creates the process groups, runs, tears them down and leaves through
`exit_process` (see parallel/dist/groups.py for why).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from launch.config import CONFIG_DIR
from parallel.core.data import load_corpus
from parallel.core.host_memory import apply_host_allocator
from parallel.dist.binding import threads_per_rank
from parallel.dist.comm import CommLog
from parallel.dist.gloo_loop import apply_gloo_loop_policy
from parallel.dist.groups import LaunchEnv, exit_process, exit_with_error, init_distributed, shutdown
from parallel.plan import build_plan

CONF = Path(CONFIG_DIR)


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


def rotation(names: list[str], round_index: int) -> list[str]:
    """The variants' order in one round: the start rotates, so no variant always runs right after
    the same other one (caches, allocator state and machine drift fall on all alike)."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def timed_step(ctx, step_fn):
    """Run one training step as one step of the communication log.

    Returns (seconds of the slowest rank on rank 0, None elsewhere; what step_fn returned; this
    rank's traffic of the step). A step lasts as long as its slowest rank.
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
