"""The validation's runs: each a `launch.train` (or, on an emulated network, `launch.run`) started
through bench/harness.py, with a loopback probe before it, the commands kept for the table.

Repeats are made at once where the check compares runs with each other (stability, loaded): three
torchruns whose ranks share the cores, each held after its first warm-up step until all have made
it, its local rank i bound to core i mod the cores meanwhile, then let go together. Made one after
another, repeats meet the host at moments a minute apart, and a shared virtual machine's core runs
the same single-threaded work faster or slower from one stretch of seconds to the next
(lab/host_speed.py measures it): their spread would be the host's as much as the clock's. Made at
once, what still separates their virtual figures is the clock itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import harness
from parallel.replay.probe import run_probe
from parallel.report.mfu import usable_cores
from parallel.runner import descendants

STRATEGIES = ["dp", "tp", "pp_1f1b", "zero2", "torch_ddp"]
PIPELINES = {"pp_gpipe": "gpipe", "pp_1f1b": "1f1b", "pp_interleaved": "interleaved_1f1b", "pp_zbh1": "zbh1",
             "pp_zbv": "zbv", "pp_dualpipev": "dualpipev"}
NETWORK_STRATEGIES = ["dp", "tp", "pp_1f1b"]
NET = ["net=ethernet_1g", "net.inter_mbit=200"]
PROBE = "parallel.replay.probe"


class Batch:
    """The runs of one invocation: the commands it ran (printed with the tables) and, with
    `sampled`, one loopback probe run taken just before each run (or each set made at once)."""

    def __init__(self, out: Path, common: list[str], sampled: bool):
        self.out, self.common, self.sampled = out, common, sampled
        self.commands: list[str] = []
        self.samples: list[dict] = []
        # Off while something else loads the machine (the loaded check's busy processes): the link
        # model is the loopback with a core per rank, and a probe beside spinning processes reads
        # their contention, not the link.
        self.probing = sampled

    def before(self, run_dirs: list[Path]) -> None:
        """What precedes a run, or a set of runs made at once: a loopback probe run (`sampled`)."""
        if self.probing:
            figures = run_probe(PROBE, 2, 120)
            self.samples.append({"before": run_dirs[0].name, "time": time.strftime("%H:%M:%S"), **figures})

    def command(self, world: int, overrides: list[str], run_dir: Path, net: list[str] | None = None) -> list[str]:
        """One run's command line (`net`: launch.run on an emulated network), recorded for the table."""
        cmd = (harness.net_command([*net, *overrides], run_dir) if net else
               harness.train_command(world, [*overrides, "run.timeline=false"], run_dir))
        self.commands.append(harness.shown(cmd))
        return cmd

    def train(self, world: int, overrides: list[str], run_dir: Path, net: list[str] | None = None) -> dict:
        self.before([run_dir])
        return harness.run(self.command(world, overrides, run_dir, net), run_dir)

    def train_together(self, world: int, overrides: list[str], run_dirs: list[Path]) -> list[dict]:
        """The same run once per directory, all at once, their timed steps lined up (`hold_until_all_stepped`)."""
        self.before(run_dirs)
        procs = []
        for d in run_dirs:
            # The hold watches this file: one left by an earlier run in the same directory would
            # stop the run before its ranks exist.
            (d / "metrics.jsonl").unlink(missing_ok=True)
            procs.append(harness.start(self.command(world, overrides, d), d))
            self.commands[-1] += " &"
        self.commands.append("wait  # each held after its first (warm-up) step until all have made it, then let go "
                             "together")
        hold_until_all_stepped(procs, run_dirs)
        summaries, failed = [], None
        for proc, d in zip(procs, run_dirs):
            try:
                summaries.append(harness.finish(proc, d))
            except harness.RunFailed as e:
                failed = failed or e
        if failed is not None:
            raise failed
        return summaries


# -- the hold: runs made at once, their timed steps side by side ------------------------------------------
def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass  # exited meanwhile: its run's return code tells


def local_rank_of(pid: int) -> int | None:
    """A torchrun worker's LOCAL_RANK, from its environment (None: not a rank, or gone)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in env:
        if entry.startswith(b"LOCAL_RANK="):
            return int(entry.split(b"=", 1)[1])
    return None


def spread_ranks_over_cores(pids: list[int], cores: list[int]) -> None:
    """Every thread of local rank i on core i mod the cores: each run made at once then has the
    same share of its ranks on each core. The cores of a shared host can slow down independently of
    each other, and left to itself the scheduler keeps a process on one core for long stretches, so
    one run's ranks could sit mostly on the slower core and another's on the faster."""
    for pid in pids:
        rank = local_rank_of(pid)
        if rank is None:
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), {cores[rank % len(cores)]})
        except OSError:
            pass  # exited meanwhile: its run's return code tells


def hold_until_all_stepped(procs: list[subprocess.Popen], run_dirs: list[Path], limit_s: float = 300) -> None:
    """Stop each run (its torchrun and every rank) once its metrics.jsonl has a line (rank 0 wrote
    its first step: the ranks are past their imports and rendezvous, inside warm-up); when every run
    is stopped, spread every run's ranks over the cores alike and continue them all at once.

    Started at once is not enough: a run spends seconds importing torch and meeting its rendezvous,
    more with a dozen processes on a few cores, and the first run's steps could be done before the
    last one's begin. A run that ends first, or `limit_s`, lets everyone go: the caller reads the
    verdicts. The stop lasts seconds, far inside a collective's timeout."""
    held: dict[int, list[int]] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(held) < len(procs) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                return
            for k, (p, d) in enumerate(zip(procs, run_dirs)):
                metrics = d / "metrics.jsonl"
                if k not in held and metrics.exists() and metrics.stat().st_size > 0:
                    held[k] = [p.pid, *descendants(p.pid)]  # the ranks: sessions of their own
                    signal_all(held[k], signal.SIGSTOP)
            time.sleep(0.01)
        if len(held) == len(procs):
            cores = sorted(os.sched_getaffinity(0))
            for pids in held.values():
                spread_ranks_over_cores(pids, cores)
    finally:
        signal_all([pid for pids in held.values() for pid in pids], signal.SIGCONT)


# -- each check's runs -------------------------------------------------------------------------------------
def layout(strategy: str) -> list[str]:
    return [f"parallel={strategy}"] + (["parallel.microbatches=4"] if strategy.startswith(("pp_", "torch_pp")) else [])


def repeats(batch: Batch, count: int, prefix: str, together: bool = True, extra: list[str] | None = None) -> dict:
    """strategy -> [(run dir, summary)]: each strategy's `count` runs at world 4, all at once
    (`together`) or one after another."""
    runs = {}
    for strategy in STRATEGIES:
        overrides = [*batch.common, *layout(strategy), *(extra or [])]
        dirs = [batch.out / f"{prefix}-{strategy}-{k}" for k in range(count)]
        summaries = (batch.train_together(4, overrides, dirs) if together
                     else [batch.train(4, overrides, d) for d in dirs])
        runs[strategy] = list(zip(dirs, summaries))
    return runs


def loaded_repeats(batch: Batch, count: int) -> tuple[dict, int]:
    """The stability repeats again while one busy process per core competes for the machine."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    batch.commands.append(f"# {len(spinners)} x python -c 'while True: pass' running during the loaded repeats"
                          + (" (no probe before these)" if batch.sampled else ""))
    batch.probing = False
    try:
        return repeats(batch, count, "loaded"), len(spinners)
    finally:
        batch.probing = batch.sampled
        for p in spinners:
            p.kill()
            p.wait()


def faithful_runs(batch: Batch, rounds: int) -> dict:
    """World 2, `rounds` rounds with the strategies taking turns in each, so that each strategy's
    runs sample the batch's moments alike."""
    runs: dict[str, list] = {s: [] for s in STRATEGIES}
    for k in range(rounds):
        for strategy in STRATEGIES:
            d = batch.out / f"w2-{strategy}-{k}"
            runs[strategy].append((d, batch.train(2, [*batch.common, *layout(strategy)], d)))
    return runs


def pipeline_runs(batch: Batch) -> dict:
    """preset -> (run dir, summary), or the verdict of a run that failed."""
    runs: dict = {}
    for preset in PIPELINES:
        # model=small: 8 layers, enough for 2 chunks per stage on 4 stages
        overrides = [*[c for c in batch.common if not c.startswith("model=")], "model=small", f"parallel={preset}",
                     "parallel.pp=4", "parallel.microbatches=8"]
        d = batch.out / f"pp4-{preset}"
        try:
            runs[preset] = (d, batch.train(4, overrides, d))
        except harness.RunFailed as e:
            runs[preset] = str(e)[-200:]
    return runs


def network_runs(batch: Batch, rounds: int) -> dict:
    """`rounds` pairs for each of dp, tp and pp_1f1b at world 2, each made back to back: a run on
    the loopback, then `launch.run` on 200 Mbit/s between 2 nodes. The prediction comes from the
    pair's loopback run and is checked against the pair's network run seconds later, so that the
    two meet the host at nearly the same moment. strategy -> [((run dir, summary), network step)],
    or why its network run failed."""
    pairs: dict[str, list | str] = {s: [] for s in NETWORK_STRATEGIES}
    for k in range(rounds):
        for strategy in NETWORK_STRATEGIES:
            if isinstance(pairs[strategy], str):
                continue  # its network run failed once: the table says why
            overrides = [*batch.common, *layout(strategy)]
            d = batch.out / f"w2net-{strategy}-{k}"
            source = (d, batch.train(2, overrides, d))
            try:
                step = batch.train(2, overrides, batch.out / f"net200-{strategy}-{k}", net=NET)["step_time_s"]
            except harness.RunFailed as e:
                pairs[strategy] = str(e)[-160:]
                continue
            pairs[strategy].append((source, step))
    return pairs
