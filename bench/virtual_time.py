"""How well virtual device time (parallel/replay/) matches what runs measure: the validation table.

    python bench/virtual_time.py [checks=stability,loaded,faithful,contention,pipelines,network] [model=tiny]
                                 [steps=8] [repeats=3] [repeats_at=once|apart] [out=runs/virtual-bench]
                                 [loopback=sampled|once|per-run] [probes=5] [rounds=5]

Each check runs `launch.train` under torchrun (or `launch.run` on an emulated network, which needs
root), reads the run's summary.json, and for some replays its saved events again:

  stability    dp, tp, pp_1f1b (m 4), zero2, torch_ddp at world 4, `repeats` times each: virtual
               tokens/s against its median (the claim: within 5%), wall tokens/s beside, and the
               host alone: one window of bench/host_speed.py's fixed single-threaded work, timed
               in this process just before each run, so that a spread the host's own speed
               brought shows as such (a virtual machine's core runs the same work slower when
               other guests load it, and a thread's CPU time grows with it). With
               `repeats_at=once` (the default) a strategy's repeats are started at the same moment,
               three torchruns whose ranks share the cores, each held after its first warm-up step
               until all have made it and its local rank i bound to core i mod the cores meanwhile,
               so that they meet the same stretches of the host alike: their spread is then the
               clock's own, and the same repeats made one after another (the contention check's
               runs) are printed beside them, the host's moments and all; `repeats_at=apart` makes
               only those
  loaded       the same (started together or apart alike) while one busy process per core competes
               for the machine
  faithful     the same at world 2 (a core per rank on a 2-core machine), `rounds` rounds: virtual
               step against wall step, the median of the runs' ratios (the claim: within 5%, on an
               idle machine)
  contention   the claim: dp, tp, pp_1f1b, zero2, torch_ddp at world 4, `repeats` runs each made
               one after another with `train.pin_cores=round_robin` (rank i on core i mod the
               cores: two ranks to a core on 2 cores), replayed with each rank on its core, the
               ranks of a core sharing it (processor sharing), on the view's link (the loopback
               probed with a core per rank, uncontended): against their wall step (within 10%).
               Beside them, for comparison, the runs of `stability` made one after another, whose
               threads the kernel placed, replayed with their 4 ranks sharing a pool of the
               machine's cores; on the loopback probed unbound (`pin_cores=off`); and
               (`sampled`) on the probe taken just before each run
  pipelines    every schedule of ours at p 4, m 8: the virtual bubble (idle share of the pipeline
               ranks' time from the step's start to its last F/B/W) against the simulator's with the
               run's measured F, B and W (CPU time per chunk-microbatch; the claim: within 3 points):
               one mean for all stages, then with the messages' costs, then each stage's own
  network      dp, tp, pp_1f1b at world 2, `rounds` pairs each made back to back: a run on the
               loopback, replayed onto net=ethernet_1g with inter_mbit=200, against launch.run on
               that emulated network just after it: the median of the pairs' ratios (the claim:
               within 10%), beside the medians of both sides

Which loopback figures the runs are replayed on (`loopback=`):

  once      probed once before the batch (parallel/replay/probe.py's method: 2 ranks, one per
            core, the mean cost of all-reduces that follow compute; each figure the median of
            `probes` probe runs) and given to every run (`virtual.loopback_*`), so that the runs
            differ only in what they measured
  per-run   each run probes its own at its end, as a plain run does
  sampled   (the default) as `once`, and besides one probe run before every run of the batch
            (but the `loaded` ones: a probe beside busy processes reads their contention, not
            the link): the tables are printed twice, first on the median of all the probes taken
            across the batch (the claim), each run replayed again from its saved events, then on
            the probe before the batch (what the runs' summaries hold). The loopback's per-call
            latency on a small shared host follows the host's moment (2-3x within minutes), and
            one probe before a 20-minute batch catches one moment; the batch's median is the
            host's figure over the time the runs took. Neither is fitted to the runs: both are
            probes. <out>/probes.json keeps every sample.

Prints the tables and the exact commands it ran, and writes them to <out>/table.md (the probes to
<out>/probes.json, the host windows to <out>/host_speed.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from host_speed import Workload, lower_median, max_dev  # noqa: E402  (bench/, this script's own folder)

from parallel.pp.actions import B, F, W  # noqa: E402
from parallel.pp.simulator import simulate_schedule, split_costs  # noqa: E402
from parallel.replay import events as saved  # noqa: E402
from parallel.replay import graph  # noqa: E402
from parallel.replay.links import LinkModel, from_net  # noqa: E402
from parallel.replay.probe import figure_overrides, link_of, measure_once, median_figures, run_probe  # noqa: E402
from parallel.replay.virtual import replay_run, replay_step, replay_steps  # noqa: E402
from parallel.report.mfu import usable_cores  # noqa: E402
from parallel.runner import descendants  # noqa: E402

STRATEGIES = ["dp", "tp", "pp_1f1b", "zero2", "torch_ddp"]
HOST_WINDOW_STEPS = 30  # bench/host_speed.py's default window: about 0.2 s of the tiny model on one thread
PIPELINES = {"pp_gpipe": "gpipe", "pp_1f1b": "1f1b", "pp_interleaved": "interleaved_1f1b", "pp_zbh1": "zbh1",
             "pp_zbv": "zbv", "pp_dualpipev": "dualpipev"}


class Batch:
    """The runs of one invocation: the commands it ran (printed with the tables) and, with
    `sampled`, one loopback probe run taken just before each run."""

    def __init__(self, out: Path, common: list[str], sampled: bool):
        self.out, self.common, self.sampled = out, common, sampled
        self.commands: list[str] = []
        self.samples: list[dict] = []
        self.host = Workload()
        self.host_cpu: dict[str, float] = {}  # run directory's name -> the host's window just before it (s a step)
        # Off while something else loads the machine (the `loaded` check's busy processes): the link
        # model is the loopback with a core per rank, and a probe beside two spinning processes reads
        # their contention (6.3-7.4 ms per ring step against 120-443 µs, 2026-12-02 20:18-20:22).
        self.probing = sampled

    def before(self, run_dirs: list[Path]) -> None:
        """What precedes a run, or a set of runs made at once: a loopback probe run (`sampled`, but
        not beside the loaded check's busy processes) and one window of the host alone, which
        stands for every run of the set."""
        if self.probing:
            figures = run_probe("parallel.replay.probe", 2, 120)
            self.samples.append({"before": run_dirs[0].name, "time": time.strftime("%H:%M:%S"), **figures})
        host = self.host.window(HOST_WINDOW_STEPS)[0]
        for d in run_dirs:
            self.host_cpu[d.name] = host

    def command(self, world: int, overrides: list[str], run_dir: Path, net: list[str] | None = None) -> list[str]:
        """One run's command line (`net`: launch.run on an emulated network), recorded for the
        table's list of commands."""
        if net:
            cmd = [sys.executable, "-m", "launch.run", *net, *overrides, f"run.dir={run_dir}"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "launch.train", *overrides, f"run.dir={run_dir}", "run.timeline=false"]
        self.commands.append(" ".join(cmd[1:]).replace(str(ROOT) + "/", ""))
        return cmd

    def train(self, world: int, overrides: list[str], run_dir: Path, net: list[str] | None = None) -> dict:
        self.before([run_dir])
        cmd = self.command(world, overrides, run_dir, net)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=900)
        return json.loads((run_dir / "summary.json").read_text())

    def train_together(self, world: int, overrides: list[str], run_dirs: list[Path]) -> list[dict]:
        """The same run once per directory, all at once: one torchrun each, their ranks sharing the
        machine's cores. One probe and one host window before them stand for all of them.

        Started at once is not enough: a run spends seconds importing torch and meeting its
        rendezvous, more with twelve processes on two cores, and the first run's steps were done
        before the third's began (dp, 30 steps: 2.7 s of steps, 3.1 s apart; the 2026-12-03 23:06
        batch). So each run is held (SIGSTOP, its torchrun and its ranks) once it has written its
        first step, a warm-up step, and all are let go together (`hold_until_all_stepped`): their
        timed steps then run side by side. While they are held, each run's local rank i is bound to core i mod
        the cores, the same in every run, so that no run sits on the slower of two cores that slow
        down independently (dp's repeats ±8.8% and zero2's ±10.4% in the 23:37 batch, their steps
        lined up but their ranks left where the scheduler put them; 5 of 5 within ±4.8% bound, in
        the 00:06 batch)."""
        self.before(run_dirs)
        procs = []
        for d in run_dirs:
            # The hold watches this file: one left by an earlier bench in the same directory would
            # stop the run before its ranks exist.
            (d / "metrics.jsonl").unlink(missing_ok=True)
            cmd = self.command(world, overrides, d)
            self.commands[-1] += " &"
            procs.append((cmd, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                text=True)))
        self.commands.append("wait  # each held after its first (warm-up) step until all have made it, then let go "
                             "together")
        hold_until_all_stepped([p for _, p in procs], run_dirs)
        failed = None
        for cmd, proc in procs:
            try:
                _, err = proc.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode and failed is None:
                failed = subprocess.CalledProcessError(proc.returncode, cmd, stderr=err)
        if failed is not None:
            raise failed
        return [json.loads((d / "summary.json").read_text()) for d in run_dirs]


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
    same share of its ranks on each core. The two cores of this kind of host slow down
    independently of each other (bench/host_speed.py beside=1: one over the other ±52%), and left to
    itself the scheduler keeps a process on one core for long stretches, so one run's ranks could
    sit mostly on the slower core and another's on the faster."""
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
    is stopped, spread every run's ranks over the cores alike (`spread_ranks_over_cores`) and
    continue them all at once. A run that ends first, or `limit_s`, lets everyone go:
    the caller reads the return codes. The stop lasts seconds, far inside a collective's timeout."""
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


class View:
    """The loopback figures a table's virtual figures stand on: each run's own (`figures` None:
    what its summary.json holds), or one set for every run (each run replayed again from its
    saved events on them)."""

    def __init__(self, name: str, figures: dict | None = None):
        self.name, self.figures = name, figures
        self._blocks: dict[Path, dict] = {}

    def link(self, summary: dict) -> LinkModel:
        if self.figures is None:
            return LinkModel.from_dict(summary["virtual"]["link_model"])
        return on_loopback(summary, self.figures, self.name)

    def virtual(self, run_dir: Path, summary: dict) -> dict:
        """The run's `virtual` block on this view's figures."""
        if self.figures is None:
            return summary["virtual"]
        if run_dir not in self._blocks:
            tokens = round(summary["virtual"]["tokens_per_s"] * summary["virtual"]["step_time_s"])
            self._blocks[run_dir] = replay_run(saved.load(run_dir), self.link(summary), tokens_per_step=tokens,
                                               flops_per_token=0.0, peak_per_device=0.0)[0]
        return self._blocks[run_dir]


def on_loopback(summary: dict, figures: dict, source: str) -> LinkModel:
    """The run's own link model with the loopback's three figures replaced by `figures` (a
    probe's): placement, lanes and scope stay the run's."""
    own = LinkModel.from_dict(summary["virtual"]["link_model"])
    intra = dataclasses.replace(own.intra, bytes_per_s=figures["bytes_per_s"], latency_s=figures["latency_s"],
                                p2p_latency_s=figures["p2p_latency_s"])
    return dataclasses.replace(own, intra=intra, source=source)


def layout(strategy: str) -> list[str]:
    return [f"parallel={strategy}"] + (["parallel.microbatches=4"] if strategy.startswith(("pp_", "torch_pp")) else [])


def replayed(run_dir: Path, summary: dict, cores: float | str | None = None, links: LinkModel | None = None) -> float:
    """The lower-median replayed step of a run's saved events (cores: processor sharing of that
    many; "bound": each rank on the core the run bound it to)."""
    events = saved.load(run_dir)
    if cores == "bound":
        cores = saved.placement(events)
        if cores is None:
            raise SystemExit(f"{run_dir}: its ranks were not each bound to one core (train.pin_cores=round_robin)")
    links = links or LinkModel.from_dict(summary["virtual"]["link_model"])
    return lower_median([r.step_s for r in replay_steps(events, links, cores)])


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"\n### {title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stability_runs(batch: Batch, repeats: int, prefix: str = "w4", together: bool = False,
                   extra: list[str] | None = None) -> dict:
    """Each strategy's `repeats` runs at world 4: one after another, or (`together`) all at once.

    Made one after another, the repeats meet the host at moments a minute apart, and this kind of
    host runs the same single-threaded work a third slower or faster from one stretch of seconds to
    the next (bench/host_speed.py): their spread is the host's as much as the clock's. Made at once,
    the repeats' ranks take turns on the same cores through the same stretches of the host, so
    what still separates their virtual figures is the clock itself: the contention between ranks
    (`repeats` x 4 ranks on the cores) that it claims to remove, and the noise of its own measurement."""
    runs = {}
    for strategy in STRATEGIES:
        overrides = [*batch.common, *layout(strategy), *(extra or [])]
        dirs = [batch.out / f"{prefix}-{strategy}-{k}" for k in range(repeats)]
        summaries = (batch.train_together(4, overrides, dirs) if together
                     else [batch.train(4, overrides, d) for d in dirs])
        runs[strategy] = list(zip(dirs, summaries))
    return runs


def stability(runs: dict, view: View, host_cpu: dict[str, float], title: str = "", base: dict | None = None,
              base_name: str = "") -> str:
    """Each strategy's repeats: virtual and wall tokens/s and the host alone, each with its largest
    deviation from its median. `base`: the same strategies' repeats made another way (`base_name`:
    without the load, or one after another), whose medians these are set against."""
    rows = []
    for strategy, summaries in runs.items():
        v = [view.virtual(d, s)["tokens_per_s"] for d, s in summaries]
        w = [s["tokens_per_s"] for _, s in summaries]
        h = [host_cpu[d.name] for d, _ in summaries]
        rows.append([strategy, " / ".join(f"{x:.0f}" for x in v), f"±{max_dev(v):.1%}",
                     " / ".join(f"{x:.0f}" for x in w), f"±{max_dev(w):.1%}",
                     " / ".join(f"{x * 1e3:.2f}" for x in h), f"±{max_dev(h):.1%}"])
        if base and strategy in base:
            v0 = statistics.median(view.virtual(d, s)["tokens_per_s"] for d, s in base[strategy])
            w0 = statistics.median(s["tokens_per_s"] for _, s in base[strategy])
            rows[-1].append(f"{statistics.median(v) / v0 - 1:+.1%} / {statistics.median(w) / w0 - 1:+.1%}")
    repeats = len(next(iter(runs.values())))
    return table(f"Stability: world 4, {repeats} repeats{title} (tokens/s; the host alone: CPU ms a step of "
                 "bench/host_speed.py's one-thread window, timed just before each run, or each set of runs "
                 "made at once)",
                 ["strategy", "virtual", "max dev. from median", "wall", "max dev. from median", "the host alone",
                  "max dev. from median"]
                 + ([f"median against the repeats {base_name}: virtual / wall"] if base else []), rows)


def call_cpu(run_dir: Path) -> list[float]:
    """Every call's CPU on every member over the run's timed steps (graph.op_cpu_samples)."""
    samples = graph.op_cpu_samples(saved.load(run_dir)) or {}
    return [c for calls in samples.values() for c in calls]


def op_cpu(unloaded: dict, loaded: dict, view: View, core_each: dict | None = None) -> str:
    """What one call's CPU is beside what the op's is: the calls' CPU (median, 90th and 99th
    percentile over every call of the repeats), and the virtual step replayed with each op's
    lower median over the run (what the engine does) and with each call's own figure.
    `core_each`: the world-2 runs with a core per rank, whose calls' CPU is given beside."""
    def quantiles(runs: list) -> str:
        calls = sorted(c for d, _ in runs for c in call_cpu(d))
        if not calls:
            return "not measured"
        return " / ".join(f"{calls[min(len(calls) - 1, int(q * len(calls)))] * 1e3:.2f}" for q in (0.5, 0.9, 0.99))

    def steps(runs: list, own_calls: bool) -> str:
        out = []
        for d, s in runs:
            events, links = saved.load(d), view.link(s)
            results = ([replay_step(events, i, links) for i in range(len(events[0]["steps"]))] if own_calls
                       else replay_steps(events, links))
            out.append(lower_median([r.step_s for r in results]))
        return f"{statistics.median(out) * 1e3:.1f}"

    rows = [[strategy, quantiles(unloaded[strategy]), quantiles(loaded[strategy]),
             f"{steps(unloaded[strategy], False)} / {steps(loaded[strategy], False)}",
             f"{steps(unloaded[strategy], True)} / {steps(loaded[strategy], True)}"]
            + ([quantiles(core_each[strategy])] if core_each and strategy in core_each else [])
            for strategy in unloaded if strategy in loaded]
    return table("What an op's CPU is: one call's against the run's median (world 4; ms)",
                 ["strategy", "a call's CPU, unloaded: median / 90th / 99th pct.", "the same, loaded",
                  "virtual step, unloaded / loaded (each op its run's lower median: the engine)",
                  "the same with each call's own CPU"]
                 + (["a call's CPU at world 2, a core per rank"] if core_each else []), rows)


def loaded_runs(batch: Batch, repeats: int, together: bool) -> tuple[dict, int]:
    """The stability runs again while one busy process per core competes for the machine."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    batch.commands.append(f"# {len(spinners)} x python -c 'while True: pass' running during the loaded repeats"
                          + (" (no probe before these)" if batch.sampled else ""))
    batch.probing = False
    try:
        return stability_runs(batch, repeats, prefix="loaded", together=together), len(spinners)
    finally:
        batch.probing = batch.sampled
        for p in spinners:
            p.kill()
            p.wait()


def faithful_runs(batch: Batch, rounds: int) -> dict:
    """World 2, `rounds` rounds with the strategies taking turns in each (one run's wall step
    moves by 10-15% from run to run even on the idle machine)."""
    runs: dict[str, list] = {s: [] for s in STRATEGIES}
    for k in range(rounds):
        for strategy in STRATEGIES:
            d = batch.out / f"w2-{strategy}-{k}"
            runs[strategy].append((d, batch.train(2, [*batch.common, *layout(strategy)], d)))
    return runs


def faithful(runs: dict, view: View) -> str:
    """Per strategy the median virtual and wall steps and the median of the per-run ratios, with
    their range."""
    rows = []
    for strategy, summaries in runs.items():
        v = [view.virtual(d, s)["step_time_s"] for d, s in summaries]
        w = [s["step_time_s"] for _, s in summaries]
        ratios = [a / b - 1 for a, b in zip(v, w)]
        rows.append([strategy, f"{statistics.median(v) * 1e3:.1f}", f"{statistics.median(w) * 1e3:.1f}",
                     f"{statistics.median(ratios):+.1%}", f"{min(ratios):+.1%} to {max(ratios):+.1%}"])
    rounds = len(next(iter(runs.values())))
    return table(f"Faithfulness: world 2, a core per rank, {rounds} rounds (step ms, medians)",
                 ["strategy", "virtual", "wall", "virtual/wall-1 (median of runs)", "range"], rows)


def contention_bound(runs: dict, view: View) -> str:
    """The claim: every world-4 run made with `train.pin_cores=round_robin` (rank i on core i mod
    the cores, two ranks to a core on 2 cores) replayed with each rank on the core it was bound to,
    each core shared by its ranks and their ops' measured CPU (processor sharing, as a core per
    rank shares its own: parallel/replay/engine.py), on the view's link: against the run's wall
    step (within 10%). Beside it the same runs replayed on a pool of the machine's cores that any
    rank may take, the replay of the unbound runs below: how much the binding itself changes."""
    cores = usable_cores()
    rows = []
    for strategy, summaries in runs.items():
        walls, placed, pooled = [], [], []
        for d, s in summaries:
            walls.append(s["step_time_s"])
            placed.append(replayed(d, s, cores="bound", links=view.link(s)))
            pooled.append(replayed(d, s, cores=cores, links=view.link(s)))
        rows.append([strategy, " / ".join(f"{w * 1e3:.1f}" for w in walls),
                     " / ".join(f"{x * 1e3:.1f} ({x / w - 1:+.1%})" for x, w in zip(placed, walls)),
                     " / ".join(f"{x / w - 1:+.1%}" for x, w in zip(pooled, walls))])
    return table(f"Contention: world-4 runs bound round-robin to {cores} cores, replayed with each rank on its "
                 "core (step ms)",
                 ["strategy", "wall", "replayed, each core shared by its ranks (replayed/wall-1)",
                  f"replayed on a pool of {cores} cores (replayed/wall-1)"], rows)


def contention(runs: dict, view: View, unbound: LinkModel, nearest: dict[str, dict] | None = None) -> str:
    """Every world-4 run replayed with its ranks sharing the machine's cores, on the view's link
    (probed with a core per rank: the claim), and beside it on the loopback as unbound ranks meet
    it on an idle machine (`unbound`: probed with `pin_cores=off`), and (`nearest`: run
    directory's name -> the figures of the probe taken just before it) on its own moment's probe.

    The loopback's per-call cost follows the host's moment as the compute does (one batch's probes
    ranged over 114-280 µs per ring step), and which strategies miss turned on which moment's
    figures the replay was given (2026-12-04 00:06: on the batch's median tp and pp_1f1b came out
    11-13% under their wall, on the probe before the batch zero2 and torch_ddp 11-37% over). The
    probe just before a run is the nearest moment to it the bench has; one probe is also one
    sample of a noisy figure, which the median is not.

    The claim uses a link probed with a core per rank, because the engine's shared cores are what
    model the contention: a handoff's wait for a core is counted by the rule that every member of
    an op in flight wants a core. The unbound probe's extra latency is that same wait, met on an
    idle machine, so replaying it under the rule counts the wait twice; it stays beside the claim
    as the comparison the earlier batches led with."""
    cores = usable_cores()
    rows = []
    for strategy, summaries in runs.items():
        walls, own, shared, near = [], [], [], []
        for d, s in summaries:
            walls.append(s["step_time_s"])
            own.append(replayed(d, s, cores=cores, links=view.link(s)))
            shared.append(replayed(d, s, cores=cores, links=unbound))
            if nearest:
                near.append(replayed(d, s, cores=cores, links=on_loopback(s, nearest[d.name], "the probe just before")))
        row = [strategy, " / ".join(f"{w * 1e3:.1f}" for w in walls),
               " / ".join(f"{x * 1e3:.1f} ({x / w - 1:+.1%})" for x, w in zip(own, walls)),
               " / ".join(f"{x / w - 1:+.1%}" for x, w in zip(shared, walls))]
        rows.append(row + ([" / ".join(f"{x / w - 1:+.1%}" for x, w in zip(near, walls))] if nearest else []))
    return table(f"Contention, unbound: world-4 runs the kernel placed, replayed with 4 ranks sharing {cores} cores "
                 "(step ms)",
                 ["strategy", "wall", f"replayed on {cores} cores (replayed/wall-1)",
                  "on the loopback probed unbound (replayed/wall-1)"]
                 + (["on the probe just before the run (replayed/wall-1)"] if nearest else []), rows)


def pipeline_bubble(run_dir: Path, summary: dict, view: View) -> tuple[float, dict]:
    """The virtual bubble of the first pipeline (the virtual block's pipeline, parallel/replay/virtual.py),
    its mean F, B, W CPU seconds per chunk-microbatch, and the CPU time of posting one send or receive."""
    block = view.virtual(run_dir, summary)
    vpipe = block["pipeline"]
    events = saved.load(run_dir)
    index = block["step_times_s"].index(block["step_time_s"])
    # The CPU time of posting sends and receives (the executor's p2p phases), per send or receive.
    p2p = [p for e in events if e["rank"] in vpipe["ranks"] for p in e["steps"][index]["phases"]
           if p["phase"] == "p2p" and p["label"] != "wait sends"]
    actions = sum(len(p["label"].split()) for p in p2p)
    # A message's time on the link model: its latency (one step) plus an activation's bytes over the rate.
    links = view.link(summary)
    sends = [sp["payload_bytes"] for e in events for sp in e["steps"][index]["spans"] if sp["op"] == "send"]
    payload = sum(sends) / max(len(sends), 1)
    costs = {"comm": sum(p["cpu_end"] - p["cpu_start"] for p in p2p) / max(actions, 1),
             "transfer": links.intra.message_latency_s + payload / links.intra.bytes_per_s,
             F: vpipe["mean_forward_s"], B: vpipe["mean_backward_s"], W: vpipe["mean_weight_s"]}
    return vpipe["bubble"], costs


def stage_costs(vpipe: dict, v: int, split: bool, comm: float, transfer: float) -> dict:
    """(pipeline stage, chunk) -> Costs from the replayed step's own F, B and W of each stage
    (the virtual block's pipeline.by_stage_s): the stages differ (the first's input gradient
    stops at the embedding), which one mean per action cannot hold. Each as a whole share's (a
    chunk's times v)."""
    return {tuple(int(x) for x in key.split(".")): split_costs(m["F"] * v, m["B"] * v, m["W"] * v if split else 0.0,
                                                              comm, transfer)
            for key, m in vpipe["by_stage_s"].items()}


def pipeline_runs(batch: Batch) -> dict:
    """preset -> (run dir, summary) or the error text of a run that failed."""
    runs: dict = {}
    for preset in PIPELINES:
        # model=small: 8 layers, enough for 2 chunks per stage on 4 stages (tiny has 4)
        overrides = [*[c for c in batch.common if not c.startswith("model=")], "model=small", f"parallel={preset}",
                     "parallel.pp=4", "parallel.microbatches=8"]
        try:
            runs[preset] = (batch.out / f"pp4-{preset}", batch.train(4, overrides, batch.out / f"pp4-{preset}"))
        except subprocess.CalledProcessError as e:
            runs[preset] = e.stderr[-200:] if e.stderr else "failed"
    return runs


def pipelines(runs: dict, view: View) -> str:
    rows, stages = [], []
    for preset, run in runs.items():
        if isinstance(run, str):
            rows.append([preset, "failed", run, "", ""])
            continue
        d, s = run
        schedule = PIPELINES[preset]
        v = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
        bubble, costs = pipeline_bubble(d, s, view)
        # Costs per microbatch through a rank's whole share: a chunk's measured time times v.
        split = costs[W] > 0
        cost = split_costs(costs[F] * v, costs[B] * v, costs[W] * v if split else 0)
        sim = simulate_schedule(schedule, 4, 8, v, cost)
        # The same with what the replay charges a message: the CPU time of posting it, and its
        # transfer on the link model (the closed forms take both as free).
        with_p2p = simulate_schedule(schedule, 4, 8, v, split_costs(cost.forward, cost.input_grad, cost.weight_grad,
                                                                     costs["comm"], costs["transfer"]))
        # The same messages, and each stage's own F, B and W (chunk by chunk) instead of one mean.
        per_stage = stage_costs(view.virtual(d, s)["pipeline"], v, split, costs["comm"], costs["transfer"])
        staged = simulate_schedule(schedule, 4, 8, v, per_stage)
        stages.append([preset, *(f"{stage}.{chunk}: {c.forward / v * 1e3:.1f} / {c.input_grad / v * 1e3:.1f} / "
                                 f"{c.weight_grad / v * 1e3:.1f}" for (stage, chunk), c in sorted(per_stage.items()))])
        rows.append([preset, f"{bubble:.1%}", f"{sim.bubble_fraction:.1%}",
                     f"{(bubble - sim.bubble_fraction) * 100:+.1f}", f"{with_p2p.bubble_fraction:.1%}",
                     f"{(bubble - with_p2p.bubble_fraction) * 100:+.1f}", f"{staged.bubble_fraction:.1%}",
                     f"{(bubble - staged.bubble_fraction) * 100:+.1f}", f"{s['pipeline']['bubble_measured']:.1%}"])
    return table("Pipelines: p 4, m 8 (bubble)",
                 ["preset", "virtual", "simulator (measured F, B, W)", "points",
                  "simulator (F, B, W, each message's posting CPU time and its transfer)", "points",
                  "simulator (each stage's own F, B, W, and the messages)", "points", "wall (measured)"], rows) + (
        stage_table(stages) if stages else "")


def stage_table(stages: list[list[str]]) -> str:
    """Each preset's per-stage F / B / W, one column per (stage, chunk) in order."""
    width = max(len(r) for r in stages)
    return table("Each stage's own F / B / W (ms of CPU time per chunk-microbatch; an unsplit schedule's B is the "
                 "whole backward)", ["preset", *["stage.chunk: F / B / W"] * (width - 1)],
                 [r + [""] * (width - len(r)) for r in stages])


NETWORK_STRATEGIES = ["dp", "tp", "pp_1f1b"]


def network_runs(batch: Batch, rounds: int) -> dict:
    """`rounds` rounds of dp, tp and pp_1f1b at world 2, each a pair made back to back: a run on
    the loopback, then `launch.run` on 200 Mbit/s between 2 nodes. The prediction comes from the
    pair's loopback run and is checked against the pair's network run, seconds apart: this host's
    own speed moves by a third from one stretch of seconds to the next (bench/host_speed.py), so a
    loopback run made a quarter of an hour before its network run (the faithfulness runs, until
    2026-12-03) compared two moments of the host as much as two networks. Pairs narrow that, and
    their median is the claim; a single pair can still straddle two stretches."""
    net = ["net=ethernet_1g", "net.inter_mbit=200"]
    pairs: dict[str, list | str] = {s: [] for s in NETWORK_STRATEGIES}  # str: why its network run failed
    for k in range(rounds):
        for strategy in NETWORK_STRATEGIES:
            if isinstance(pairs[strategy], str):
                continue  # its network run failed once: the table says why
            overrides = [*batch.common, *layout(strategy)]
            d = batch.out / f"w2net-{strategy}-{k}"
            source = (d, batch.train(2, overrides, d))
            try:
                step = batch.train(2, overrides, batch.out / f"net200-{strategy}-{k}", net=net)["step_time_s"]
            except subprocess.CalledProcessError as e:
                pairs[strategy] = (e.stderr or "failed")[-160:]
                continue
            pairs[strategy].append((source, step))
    return pairs


def span_ms(steps: list[float]) -> str:
    """Steps in ms: the median (the range)."""
    return f"{statistics.median(steps) * 1e3:.1f} ({min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f})"


def network(pairs: dict, view: View) -> str:
    """Each pair's loopback run replayed onto 200 Mbit/s between 2 nodes, against the pair's run
    on that emulated network: the median of the pairs' ratios (the claim), their range, and the
    medians of both sides."""
    rows = []
    for strategy, runs in pairs.items():
        if isinstance(runs, str):
            rows.append([strategy, "", "failed", runs, ""])
            continue
        predicted, measured = [], []
        for (d, s), step in runs:
            links = from_net({"name": "ethernet_1g", "nodes": 2, "procs_per_node": 1, "inter_mbit": 200}, view.link(s))
            predicted.append(replayed(d, s, links=links))
            measured.append(step)
        ratios = [p / m - 1 for p, m in zip(predicted, measured)]
        rows.append([strategy, span_ms(predicted), span_ms(measured),
                     f"{statistics.median(ratios):+.1%}", f"{min(ratios):+.1%} to {max(ratios):+.1%}"])
    rounds = max((len(r) for r in pairs.values() if not isinstance(r, str)), default=0)
    return table(f"Network what-if: {rounds} pairs each, a loopback run at world 2 replayed onto 200 Mbit/s between "
                 "2 nodes against launch.run on it made just after (step ms, medians and ranges)",
                 ["strategy", "replayed", "launch.run measured", "replayed/measured-1 (median of pairs)", "range"],
                 rows)


def said(figures: dict) -> str:
    """A probe's figures (`measure_once`'s keys) in words."""
    return (f"{figures['bytes_per_s'] / 1e9:.2f} GB/s, {figures['latency_s'] * 1e6:.0f} µs per ring step, "
            f"{figures['p2p_latency_s'] * 1e6:.0f} µs per message")


def spread(samples: list[dict]) -> str:
    """The range of a batch's probe samples, each figure's lowest and highest."""
    def span(key: str, scale: float, unit: str, digits: int) -> str:
        values = [s[key] * scale for s in samples]
        return f"{min(values):.{digits}f}-{max(values):.{digits}f} {unit}"
    return ", ".join([span("bytes_per_s", 1e-9, "GB/s", 2), span("latency_s", 1e6, "µs per ring step", 0),
                      span("p2p_latency_s", 1e6, "µs per message", 0)])


def main(argv: list[str]) -> None:
    opts = {"checks": "stability,loaded,faithful,contention,pipelines,network", "model": "tiny", "steps": "8",
            "repeats": "3", "repeats_at": "once", "out": "runs/virtual-bench", "loopback": "sampled", "probes": "5",
            "rounds": "5"}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option {key!r}: {', '.join(opts)}")
        opts[key] = value
    if opts["loopback"] not in ("once", "per-run", "sampled"):
        raise SystemExit(f"loopback={opts['loopback']!r}: once, per-run or sampled")
    if opts["repeats_at"] not in ("once", "apart"):
        raise SystemExit(f"repeats_at={opts['repeats_at']!r}: once (the repeats started together) or apart "
                         "(one after another)")
    together = opts["repeats_at"] == "once"
    if together and opts["loopback"] == "per-run":
        raise SystemExit("repeats_at=once needs loopback=sampled or once: with loopback=per-run each run probes "
                         "the loopback at its end, while the other repeats still load the cores, and reads their "
                         "contention, not the link (give repeats_at=apart with loopback=per-run)")
    checks = opts["checks"].split(",")
    unknown = set(checks) - {"stability", "loaded", "faithful", "contention", "pipelines", "network"}
    if unknown:
        raise SystemExit(f"unknown check(s) {', '.join(sorted(unknown))}: stability, loaded, faithful, contention, "
                         "pipelines, network")
    out = ROOT / opts["out"]
    out.mkdir(parents=True, exist_ok=True)
    common = [f"model={opts['model']}", f"train.steps={opts['steps']}"]
    batch = Batch(out, common, sampled=opts["loopback"] == "sampled")
    probes_read: list[str] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    if opts["loopback"] in ("once", "sampled"):
        # One probe for every run (2 ranks, one per core), so that the runs differ only in what they
        # measured: each figure the median of `probes` probe runs.
        loop = measure_once(int(opts["probes"]))
        probes_read.append(f"loopback probed bound before the batch (every run's link): {said(loop)}")
        batch.commands.append(f"# {opts['probes']} x, the median of each figure:\n"
                              "torch.distributed.run --standalone --nproc-per-node=2 -m parallel.replay.probe")
        batch.common += figure_overrides(loop)
    if batch.sampled:
        batch.commands.append("# before every run below, once: torch.distributed.run --standalone "
                              "--nproc-per-node=2 -m parallel.replay.probe")

    # Every run first, the tables after: with `sampled`, the tables need the probes of the whole batch.
    # The contention check replays runs made one at a time (4 ranks on the cores, nothing else): the
    # stability check's repeats are made at once unless repeats_at=apart, and then it shows the
    # contention check's runs beside them, the same repeats made one after another.
    repeats = int(opts["repeats"])
    apart = "contention" in checks or ("stability" in checks and not together)
    w4 = stability_runs(batch, repeats) if apart else {}
    w4_once = (stability_runs(batch, repeats, prefix="w4once", together=True)
               if together and "stability" in checks else {})
    unbound = None
    # The contention check's claim: the same runs with their ranks dealt to the cores in turn.
    w4_bound = (stability_runs(batch, repeats, prefix="w4rr", extra=["train.pin_cores=round_robin"])
                if "contention" in checks else {})
    if "contention" in checks:
        # The loopback as unbound ranks meet it on an idle machine: the comparison column.
        figures = measure_once(int(opts["probes"]), pin_cores="off")
        probes_read.append(f"loopback probed unbound (the contention replays' comparison): {said(figures)}")
        batch.commands.append(f"# {opts['probes']} x, the median of each figure (the contention replays' comparison):\n"
                              "torch.distributed.run --standalone --nproc-per-node=2 -m parallel.replay.probe "
                              "batch off")
        unbound = link_of(figures, "probed unbound (pin_cores=off)")
    loaded, spinners = loaded_runs(batch, repeats, together) if "loaded" in checks else ({}, 0)
    w2 = faithful_runs(batch, int(opts["rounds"])) if "faithful" in checks else {}
    pp4 = pipeline_runs(batch) if "pipelines" in checks else {}
    net = network_runs(batch, int(opts["rounds"])) if "network" in checks else None

    views = [View("each run's own figures" if opts["loopback"] == "per-run" else "the probe before the batch")]
    if batch.sampled:
        # The claim first: the batch's median; the probe before the batch (the runs' own figures) after it.
        median = median_figures(batch.samples)
        views.insert(0, View(f"the median of {len(batch.samples)} probes across the batch", median))
        probes_read.append(f"{len(batch.samples)} probe runs, one before each run: median {said(median)}; "
                           f"range {spread(batch.samples)}")
        (out / "probes.json").write_text(json.dumps(batch.samples, indent=1) + "\n")
    (out / "host_speed.json").write_text(json.dumps(batch.host_cpu, indent=1) + "\n")
    parts = [f"# virtual time validation, {started}, {usable_cores()} cores, model {opts['model']}, "
             f"{opts['steps']} steps, loopback={opts['loopback']}, repeats_at={opts['repeats_at']}"]
    for view in views:
        parts.append(f"\n## Replayed on {view.name}")
        if w4_once:
            parts.append(stability(w4_once, view, batch.host_cpu,
                                   f", started together ({repeats} x 4 ranks on the cores)", w4,
                                   "made one after another"))
        if "stability" in checks and w4:
            parts.append(stability(w4, view, batch.host_cpu, ", made one after another"
                                   + (" (the contention check's runs)" if together else "")))
        if "contention" in checks:
            # The probe just before each run does not depend on the view: its column once, in the first.
            nearest = {x["before"]: x for x in batch.samples} if view is views[0] else None
            parts.append(contention_bound(w4_bound, view))
            parts.append(contention(w4, view, unbound, nearest))
        if loaded:
            unloaded = w4_once if together else w4
            parts.append(stability(loaded, view, batch.host_cpu,
                                   f", {spinners} busy processes beside them"
                                   + (", started together" if together else ", made one after another"),
                                   unloaded, "made the same way without the load"))
            if unloaded:
                parts.append(op_cpu(unloaded, loaded, view, w2))
        if w2:
            parts.append(faithful(w2, view))
        if pp4:
            parts.append(pipelines(pp4, view))
        if net:
            parts.append(network(net, view))
    parts.append("\n### Probes\n\n" + "\n".join(f"- {line}" for line in probes_read))
    parts.append("\n### Commands\n\n```\n" + "\n".join(batch.commands) + "\n```")
    text = "\n".join(parts)
    print(text)
    (out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
