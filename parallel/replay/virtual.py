"""A run's timed steps replayed: summary.json's `virtual` block and the virtual trace.

Each timed step is replayed on its own, every rank starting it at 0 (graph.py, engine.py). As for
the wall clock (parallel/report/summary.py, breakdown.py), the run's figure is the lower median of
the steps' times (a step lasts as long as its slowest rank), and the breakdown is that step's:
per rank, where its virtual time went, in the wall breakdown's five categories,

    compute       the time of its forward, backward, weight and recompute phases on its device
    exposed_comm  blocked in a call or a wait, by "op group" (pipeline p2p excluded)
    bubble        blocked in pipeline sends and receives (group pp)
    optimizer     the time of its optimizer phase
    other         the time of its other phases, plus the wait for the slowest rank

(a rank's device: one core and its compute thread's CPU time, or, for a rank of several intra-op
threads, its cores and the wall clock: device.py; `device_per_rank` in the block says which)

which add up to the step on every rank (by construction: a rank is always computing or blocked).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from parallel.core.phases import CATEGORY_OF_PHASE
from parallel.replay import device, graph
from parallel.replay.engine import Result, run
from parallel.replay.links import LinkModel

CATEGORIES = ("compute", "exposed_comm", "bubble", "optimizer", "other")
# The phases of a pipeline action's own work (a recompute runs inside its B, and carries its label).
PIPELINE_WORK = frozenset({"forward", "backward", "weight", "recompute"})
WAITING_FOR_SLOWEST = "waiting for the slowest rank"


def replay_step(events: list[dict], index: int, links: LinkModel, cores: float | list | None = None,
                compute_scale: float = 1.0, with_cpu: bool = True, op_cpu: dict | None = None) -> Result:
    """Step `index` of the saved run replayed; `with_cpu`: charge each rank's core with the CPU its
    communication took (False: a device with its own copy engines: the cluster what-if, a GPU run);
    `op_cpu`: the run's `graph.median_op_cpu`, each op's typical CPU instead of this step's call's
    (`replay_steps` passes it; None: the step's own figures). A rank of several intra-op threads
    is read on its wall stamps (device.py)."""
    steps = [device.replayed_step(e, index) for e in events]
    programs = graph.build(steps, [e["groups"] for e in events], links, compute_scale, with_cpu, op_cpu)
    bandwidth, buckets = _link_figures(programs, links)
    return run(programs, bandwidth, cores, buckets)


def replay_steps(events: list[dict], links: LinkModel, cores: float | list | None = None, compute_scale: float = 1.0,
                 with_cpu: bool = True) -> list[Result]:
    """Every timed step of the saved run replayed.

    With a core per rank (`cores` None: the virtual clock) each op is charged the lower median of
    its CPU over the run's steps (graph.median_op_cpu): one call's figure carries the contention of
    the machine the run shared, which a core per rank would not meet. With the ranks sharing
    `cores` (the contention replay, which reproduces that machine) each call keeps its own figure:
    the CPU the contended run really spent is part of what it waited on."""
    n_steps = min(len(e["steps"]) for e in events)
    op_cpu = graph.median_op_cpu(device.as_replayed(events)) if with_cpu and cores is None else None
    return [replay_step(events, i, links, cores, compute_scale, with_cpu, op_cpu) for i in range(n_steps)]


def _link_figures(programs, links: LinkModel) -> tuple[dict, dict]:
    """The rate of every link the ops load, and the token bucket of those that have one."""
    rates, buckets = {}, {}
    for program in programs:
        for task in program:
            op = getattr(task, "op", None)
            if op is not None:
                for link in op.demand:
                    rates[link] = links.bandwidth(link)
                    if (bucket := links.bucket(link)) is not None:
                        buckets[link] = bucket
    return rates, buckets


def rank_breakdown(result: Result, rank: int) -> dict:
    """The five categories of one rank's replayed step (seconds), and its exposed comm by op and group."""
    parts = dict.fromkeys(CATEGORIES, 0.0)
    exposed: dict[str, float] = defaultdict(float)
    for i in result.intervals:
        if i.rank != rank or i.kind == "post":
            continue
        seconds = i.end - i.start
        if i.kind == "compute":
            category = CATEGORY_OF_PHASE[i.name]
            parts[category if category in parts else "other"] += seconds
        elif i.category == "bubble":
            parts["bubble"] += seconds
        else:
            parts["exposed_comm"] += seconds
            op = i.op
            exposed[f"{op.name.split()[0]} {op.key[1]}" if op is not None else i.name] += seconds
    parts["other"] += result.step_s - result.ends[rank]
    return {"parts": parts, "exposed_by_op": dict(exposed), "end_s": result.ends[rank]}


def pipeline_figures(result: Result, events: list[dict]) -> dict | None:
    """A pipeline's replayed bubble, as the wall clock's is measured (parallel/pp/timeline.py): the
    idle share of the first pipeline's ranks' time, from the step's start to its last F, B or W;
    and the mean CPU seconds of one chunk-microbatch's F, B and W there (the closed forms' and the
    simulator's inputs, in virtual time), over all stages and per "stage.chunk" (`by_stage_s`).
    None for a run without our pipeline's actions (no pp, or PyTorch's schedules, whose actions
    run inside torch as one compute phase)."""
    if len({e["coords"].get("pp", 0) for e in events}) < 2:
        return None
    first = {e["rank"] for e in events if all(v == 0 for d, v in (e.get("coords") or {}).items() if d != "pp")}
    work = [i for i in result.intervals if i.rank in first and i.kind == "compute" and i.name in PIPELINE_WORK
            and i.label[:1] in ("F", "B", "W")]
    if not work:
        return None
    end = max(i.end for i in work)
    busy = sum(i.end - i.start for i in work)
    mean = {}
    for op in ("F", "B", "W"):
        pieces = [i for i in work if i.label.startswith(op)]
        actions = {(i.rank, i.label) for i in pieces}  # a recompute and its backward are one B
        mean[op] = sum(i.end - i.start for i in pieces) / len(actions) if actions else 0.0
    # Each stage's own, chunk by chunk: the stages differ (the first's B stops at the embedding).
    stage_of = {e["rank"]: e["coords"].get("pp", 0) for e in events if e["rank"] in first}
    seconds: dict[tuple, float] = defaultdict(float)
    labels: dict[tuple, set] = defaultdict(set)
    for i in work:
        key = (stage_of[i.rank], int(i.label.partition(".")[2] or 0), i.label[0])
        seconds[key] += i.end - i.start
        labels[key].add(i.label)
    by_stage: dict[str, dict] = defaultdict(lambda: dict.fromkeys(("F", "B", "W"), 0.0))
    for (stage, chunk, op), total in sorted(seconds.items()):
        by_stage[f"{stage}.{chunk}"][op] = total / len(labels[(stage, chunk, op)])
    return {"bubble": 1.0 - busy / (len(first) * end) if end > 0 else 0.0, "ranks": sorted(first),
            "mean_forward_s": mean["F"], "mean_backward_s": mean["B"], "mean_weight_s": mean["W"],
            "by_stage_s": dict(by_stage)}


def waits_on(mean: dict, exposed_by_op: dict) -> str:
    """What the replayed step waits on, in a sentence."""
    step = sum(mean.values())
    waiting = {k: v for k, v in mean.items() if k in ("exposed_comm", "bubble")}
    worst = max(waiting, key=waiting.get)
    if step <= 0 or waiting[worst] < 0.05 * step:
        return "compute: communication and the pipeline cost under 5% of the step"
    if worst == "bubble":
        return f"the pipeline: {mean['bubble'] / step:.0%} of the step waiting for a neighbour stage"
    top = max(exposed_by_op, key=exposed_by_op.get) if exposed_by_op else "communication"
    return f"communication: {mean['exposed_comm'] / step:.0%} of the step blocked, most in {top}"


def replay_run(events: list[dict], links: LinkModel, *, tokens_per_step: int, flops_per_token: float,
               peak_per_device: float, cores: float | list | None = None, compute_scale: float = 1.0,
               what_if: str | None = None, comm_cpu: bool | None = None, period: int = 1) -> tuple[dict, list[dict]]:
    """The `virtual` block and the median step's virtual trace of every rank. `comm_cpu`: charge
    the CPU each rank's communication took to its core (None: yes, but in a cluster what-if).
    `period`: steps per sync of a strategy that syncs once per H steps (DiLoCo; its closed form's
    `period_steps`): its step and breakdown are then the mean over the whole periods replayed
    (`mean_steps`), a sync's H-th share in each, as the planner predicts them."""
    charged = what_if is None if comm_cpu is None else comm_cpu
    n_steps = min(len(e["steps"]) for e in events)
    if n_steps == 0:
        raise ValueError("no timed step was saved: nothing to replay")
    results = replay_steps(events, links, cores, compute_scale, with_cpu=charged)
    times = [r.step_s for r in results]
    index = sorted(range(n_steps), key=lambda i: times[i])[(n_steps - 1) // 2]
    result = results[index]
    world = len(events)
    counted = mean_steps(n_steps, period) or [index]
    by_rank, exposed = [], defaultdict(float)
    for rank in range(world):
        b = [rank_breakdown(results[i], rank) for i in counted]
        parts = {c: statistics.fmean(x["parts"][c] for x in b) for c in CATEGORIES}
        by_rank.append({"rank": rank, **parts, "step_s": statistics.fmean(x["end_s"] for x in b),
                        "coords": events[rank].get("coords")})
        for x in b:
            for k, v in x["exposed_by_op"].items():
                exposed[k] += v / world / len(counted)
    mean = {c: statistics.fmean(r[c] for r in by_rank) for c in CATEGORIES}
    measured = [op.cpu for op in result.ops if op.cpu is not None] if cores is None else []
    step_s = statistics.fmean(times[i] for i in counted)
    tokens_per_s = tokens_per_step / step_s if step_s > 0 else 0.0
    block = {
        "step_time_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": {"mfu": flops_per_token * tokens_per_s / (peak_per_device * world) if peak_per_device else None,
                "peak_flops_per_device": peak_per_device, "devices": world,
                "definition": "one device per rank: the FLOPs of the virtual step over the peak of the rank's cores "
                              "(the machine's measured peak / its usable cores, times the rank's cores)"
                if what_if is None else "one device per rank at the cluster's peak"},
        "time_breakdown_s": mean,
        "time_breakdown_by_rank": by_rank,
        "exposed_comm_by_op_s": dict(sorted(exposed.items(), key=lambda kv: -kv[1])),
        "waits_on": waits_on(mean, exposed),
        "step": events[0]["steps"][index]["step"],
        "step_times_s": times,
        "pipeline": pipeline_figures(result, events),
        "link_model": links.as_dict(),
        "cores": cores,
        "communication_cpu_s": statistics.fmean(sum(c.get(r, 0.0) for c in measured) for r in range(world))
        if measured else None,
        "compute_scale": compute_scale,
        "what_if": what_if,
        "device_per_rank": device.run_device(events),
        "definition": _definition(events, charged, cores, what_if),
    }
    return block, virtual_traces(result, events, index)


def mean_steps(n_steps: int, period: int) -> list[int]:
    """The steps a periodic strategy's figure is the mean of: the last whole periods among the n replayed
    (every H-th of them holds a sync); none where it syncs every step or fewer than H steps were saved."""
    if period <= 1 or n_steps < period:
        return []
    return list(range(n_steps % period, n_steps))


def _definition(events: list[dict], charged: bool, cores, what_if: str | None) -> str:
    """The block's `definition`: what a rank's device is, and how the step was put together."""
    devices = {device.device_of(e) for e in events}
    on_wall = any(d.clock == device.WALL for d in devices)
    return ("each timed step replayed with a device per rank (parallel/replay/): "
            + (next(iter(devices)).describe() if len(devices) == 1 else "each rank's cores as device_per_rank says")
            + " (a core per intra-op thread: one thread's CPU time, or several threads' wall time, "
            "parallel/replay/device.py), communication by the link model, the CPU the communication took "
            + ("already in the wall time of the compute of a rank of several threads; elsewhere " if on_wall else "")
            + ("sharing the rank's core" if charged else "taking none of it (a device's copy engine)")
            + "; the lower median over the timed steps"
            + ("" if cores is None else
               f"; the ranks on the cores the run bound them to ({_cores_of(cores)}), each core "
               "shared by its ranks" if isinstance(cores, (list, tuple)) else
               f"; everything by processor sharing of {cores:g} cores")
            + ("" if what_if is None else "; what-if: compute scaled to the cluster's devices"))


def _cores_of(placement: list) -> str:
    """Each rank's core in words: `rank:core`, the machine named only where the ranks span several."""
    machines = {p[0] if isinstance(p, (list, tuple)) else None for p in placement}
    def one(p):
        if not isinstance(p, (list, tuple)):
            return str(p)
        return f"{str(p[0])[:8]}/{p[1]}" if len(machines) > 1 else str(p[1])
    return ", ".join(f"{r}:{one(p)}" for r, p in enumerate(placement))


def virtual_traces(result: Result, events: list[dict], index: int) -> list[dict]:
    """Per rank, the replayed step as report/trace.py draws one: phases tiling the step and spans."""
    traces = []
    for rank in range(len(events)):
        phases, spans = [], []
        for i in sorted((i for i in result.intervals if i.rank == rank), key=lambda i: (i.start, i.kind != "post")):
            if i.kind == "post":
                spans.append(_span(i, blocked=False))
                continue
            phase, label = (i.name, i.label) if i.kind == "compute" else (i.label or "other", "")
            if i.kind == "blocked":
                spans.append(_span(i, blocked=True))
            if phases and phases[-1]["phase"] == phase and abs(phases[-1]["end"] - i.start) < 1e-12:
                phases[-1]["end"] = i.end
            else:
                phases.append({"phase": phase, "label": label, "start": i.start, "end": i.end})
        traces.append({"step": events[rank]["steps"][index]["step"], "origin_wall": 0.0, "phases": phases,
                       "spans": spans})
    return traces


def _span(i, blocked: bool) -> dict:
    op = i.op
    parts = (op.name if op is not None else i.name).split(" ", 2)
    what, group, tag = (parts + ["", "", ""])[:3]
    return {"kind": "wait" if blocked else "post", "op": what, "group": group, "tag": tag,
            "payload_bytes": int(sum(op.demand.values())) if op is not None else 0, "sent_bytes": 0.0,
            "start": i.start, "end": i.end, "blocked": blocked}
