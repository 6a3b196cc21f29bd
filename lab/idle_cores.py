"""Where a run with more ranks than cores spends the cores' time: its ranks' own CPU, the rest of
the machine, or nothing at all.

    python -m lab.idle_cores <launch.train overrides ...> [world=4] [out=runs/idle-cores]

Runs `launch.train` under torchrun through parallel/runner.py (one run, `world` ranks on this
machine's cores) and reads the
kernel's per-CPU counters (/proc/stat) at two moments: when rank 0 has written its last warm-up step
to metrics.jsonl and when it has written its last step. Between them, the cores' time splits into
time idle (the kernel's idle and iowait), time busy, and of the busy time what the run's own ranks
took: the CPU every rank's compute thread and its other threads (gloo's) counted over the same
steps, from the run's saved events (the clock virtual time replays). Busy time the ranks did not
count is the rest of the machine, and each process's own CPU (/proc/<pid>/stat: the kernel keeps it
in ns, so it is not sampled like /proc/stat's ticks) splits it: the ranks' processes outside their
timed steps (their compute threads, the main ones, and their other threads apart: the loss's
all-reduce, the next batch, the metrics), torchrun's agent, this script's own polling of
metrics.jsonl; what is left is the kernel's interrupt work outside any of them and anything else.
The ticks that landed in interrupt work are printed too, with a caveat: on a kernel without
CONFIG_IRQ_TIME_ACCOUNTING (this machine's) the softirq work a thread runs on its way out of a
system call is also in that thread's own CPU clock, so those ticks overlap the ranks' own CPU and
are not a part of the rest.

Printed per timed step (mean over the timed steps, core-ms): the cores' time (cores x wall step),
idle, the ranks' own CPU, the rest and its parts; and the same for the run's replay with its ranks
sharing the cores (`launch.replay <run> cores=C`: the engine's processor sharing of the same CPU;
a run made with `train.pin_cores=round_robin` on its ranks' own cores, `cores=bound`), whose idle
is the cores' time it left unused waiting on dependencies.

Why: the contention check (docs/virtual-time.md) replays world-4 runs on 2 shared cores, and tp's
and pp_1f1b's replays come out under their wall steps. The ranks' own CPU is the same in both;
what differs is how much of the cores' time went unused, and this says whether the machine spent
it idle or on work the ranks' clocks do not see.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import harness
from parallel import runner
from parallel.dist.timing import default_warmup_steps
from parallel.replay import events as saved
from parallel.replay.links import LinkModel
from parallel.replay.virtual import replay_steps


def cpu_ticks(cpus: set[int]) -> dict[str, int]:
    """The summed /proc/stat counters (clock ticks) of the given CPUs: idle (idle + iowait), busy, and the
    ticks that landed in the kernel's interrupt work (irq + softirq: on loopback, the receiving half of
    every send). The kernel samples each tick's context; without CONFIG_IRQ_TIME_ACCOUNTING (this
    machine's kernel) softirq work run on a thread's way out of a system call is also counted in that
    thread's own CPU clock, so these ticks overlap the ranks' own CPU rather than sit beside it."""
    idle = busy = irqs = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, idl, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        idle += idl + iowait
        busy += user + nice + system + irq + softirq + steal
        irqs += irq + softirq
    return {"idle": idle, "busy": busy, "irqs": irqs}


def process_stat(pid: int, tid: int | None = None) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (field 3 of proc(5) first), or one thread's
    (/proc/<pid>/task/<tid>/stat); [] once it is gone."""
    path = Path(f"/proc/{pid}/stat") if tid is None else Path(f"/proc/{pid}/task/{tid}/stat")
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def cpu_of(fields: list[str]) -> int:
    """utime + stime (fields 14 and 15 of proc(5)), in clock ticks; 0 for a process that is gone."""
    return int(fields[11]) + int(fields[12]) if fields else 0


def process_ticks(pid: int) -> int:
    """A process's own CPU (clock ticks of all its threads, not of its children)."""
    return cpu_of(process_stat(pid))


def children_ticks(parent: int) -> tuple[int, int]:
    """The summed own CPU of every process below `parent` (the agent's workers, the ranks), split into
    their main threads' (each rank's compute thread) and their other threads' (gloo's, and any other)."""
    main = every = 0
    for pid in runner.descendants(parent):
        every += process_ticks(pid)
        main += cpu_of(process_stat(pid, pid))
    return main, every - main


def counters(cpus: set[int], agent: int) -> dict[str, int]:
    """Every counter the split reads at one mark, in clock ticks."""
    main, others = children_ticks(agent)
    return {**cpu_ticks(cpus), "agent": process_ticks(agent), "ranks_main": main, "ranks_others": others,
            "bench": process_ticks(os.getpid())}


def lines(path: Path, seen: dict) -> int:
    """metrics.jsonl's lines, read again only when its size has changed: the script polls it every
    2 ms on the cores it measures, so each poll should cost a stat, not a read."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if seen.get("size") != size:
        seen["size"], seen["lines"] = size, path.read_text().count("\n")
    return seen["lines"]


def run(overrides: list[str], world: int, run_dir: Path) -> tuple[dict, dict, int]:
    """The run, and the counters at the end of warm-up and at its last step (their steps between)."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    steps = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("train.steps=")), 30)
    given = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.warmup_steps=")), "null")
    warmup = default_warmup_steps(steps) if given == "null" else int(given)
    given_steps = any(o.startswith("train.steps=") for o in overrides)
    cmd = harness.train_command(world, [*overrides, *([] if given_steps else [f"train.steps={steps}"]),
                                        "run.timeline=false"], run_dir)
    print(harness.shown(cmd))
    cpus = os.sched_getaffinity(0)
    proc = runner.start(cmd, run_dir)
    marks: dict[str, dict] = {}
    metrics, seen = run_dir / "metrics.jsonl", {}
    while proc.poll() is None and len(marks) < 2:
        n = lines(metrics, seen)
        if n >= warmup and "start" not in marks:
            marks["start"] = counters(cpus, proc.pid)
        if n >= steps and "start" in marks:
            marks["end"] = counters(cpus, proc.pid)
        time.sleep(0.002)
    status, error = runner.finish(proc, run_dir, harness.RUN_TIMEOUT_S)
    if status != "ok":
        raise SystemExit(f"the run failed: {error}")
    if len(marks) < 2:
        raise SystemExit("the run ended before both marks were read: give more train.steps")
    return marks["start"], marks["end"], steps - warmup


def own_cpu(events: list[dict], timed: int) -> tuple[float, float, float]:
    """Per timed step, the ranks' own CPU: their compute threads' and their other threads' (gloo's)
    while the step ran, summed over the ranks; and the wall step (the slowest rank's)."""
    n = len(events[0]["steps"])
    steps = range(n - timed, n)
    main = statistics.mean(sum(e["steps"][i]["cpu_s"] for e in events) for i in steps)
    others = statistics.mean(sum(e["steps"][i]["phases"][-1]["helper_end"] - e["steps"][i]["phases"][0]["helper_start"]
                                 for e in events) for i in steps)
    wall = statistics.mean(max(e["steps"][i]["wall_s"] for e in events) for i in steps)
    return main, others, wall


def replayed(run_dir: Path, events: list[dict], cores: int) -> tuple[float, str]:
    """The run's replayed step: a run bound two to a core (train.pin_cores=round_robin) on its ranks'
    cores, as the contention check replays it; an unbound one on a pool of the cores."""
    summary = json.loads((run_dir / "summary.json").read_text())
    links = LinkModel.from_dict(summary["virtual"]["link_model"])
    placement = saved.placement(events)
    step = statistics.mean(r.step_s for r in replay_steps(events, links, placement or cores))
    return step, (f"replayed, each rank on its bound core of {cores}" if placement
                  else f"replayed on {cores} shared cores")


HEADER = ("| clock | step ms | cores x step | idle | the ranks' own CPU | the rest of the machine "
          "| of it: the ranks' compute threads beyond their steps | the ranks' other threads beyond their steps "
          "| torchrun's agent | this script's polling | irq+softirq ticks (partly in the ranks' own) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str]) -> None:
    world, out, overrides = 4, Path("runs") / "idle-cores", []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "world":
            world = int(value)
        elif key == "out":
            out = Path(value)
        else:
            overrides.append(arg)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start, end, timed = run(overrides, world, out)
    cores, tick = len(os.sched_getaffinity(0)), os.sysconf("SC_CLK_TCK")
    per_step = {key: (end[key] - start[key]) / tick / timed for key in start}
    events = saved.load(out)
    own_main, own_others, wall = own_cpu(events, timed)
    own = own_main + own_others
    step, how = replayed(out, events, cores)

    def row(name: str, step: float, idle_s: float, rest_s: float, *parts: float) -> str:
        total = cores * step
        return (f"| {name} | {step * 1e3:.1f} | {total * 1e3:.1f} | {idle_s * 1e3:.1f} ({idle_s / total:.0%}) | "
                f"{own * 1e3:.1f} ({own / total:.0%}) | {rest_s * 1e3:.1f} ({rest_s / total:.0%}) | "
                + " | ".join(f"{part * 1e3:.1f}" for part in parts) + " |")

    print(f"\n{timed} timed steps, {world} ranks on {cores} cores, means per step (core-ms)\n\n{HEADER}")
    # /proc/stat's ticks over the timed steps: the two marks' busy and idle, scaled to the step (the
    # marks fall between ticks); the processes' own CPU is kept in ns (reported in ticks), so it is not scaled.
    scale = cores * wall / (per_step["idle"] + per_step["busy"])
    print(row("wall (/proc/stat between the marks)", wall, per_step["idle"] * scale, per_step["busy"] * scale - own,
              per_step["ranks_main"] - own_main, per_step["ranks_others"] - own_others, per_step["agent"],
              per_step["bench"], per_step["irqs"] * scale))
    print(row(how, step, cores * step - own, *[0.0] * 6))


if __name__ == "__main__":
    main(sys.argv[1:])
