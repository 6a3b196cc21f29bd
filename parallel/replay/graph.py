"""From the events a run saved to the replay engine's programs: one step, every rank.

A rank's saved step (events.py) is its phases, each with wall and CPU seconds from the step's
start, and its communication spans in the order it made them, each with the CPU time at its start
and end, its peer, its id and, for a wait, the ids of the posts it waits for. The program:

* compute: the thread's CPU time between one call and the next, cut where the phases change (so
  that each piece keeps its phase: forward, backward, optimizer, ...); a rank of several intra-op
  threads comes here with its wall stamps in place of its CPU ones (device.py);
* a blocking call or a wait: the CPU time inside it is left out (the rank was communicating; the
  link model times that instead);
* a post (an async call; PyTorch's pipeline posts, drawn as blocking calls, are posts here): the
  rank goes on; its CPU time is the rank's own and stays in the next compute piece.

Matching, across ranks: the k-th collective a rank made on a group (its name and its members)
is the k-th of every member; the k-th message from rank a to rank b on a group is the k-th that b
received from a. A collective's bytes and links are those of the algorithm gloo runs
(parallel/net/predict.py: ring all-reduce, reduce-scatter as an all-reduce and a slice, ring
all-gather, binomial broadcast, all-to-all blocks); its latency is the per-step latency of its
links times the algorithm's steps (STEPS). A group's collectives start in their order, at most
`links.lanes` at once (gloo's two worker threads; NCCL's one stream in a cluster what-if). A
message's latency is its link's `message_latency_s` (on loopback probed apart from a collective's:
gloo sends and receives on the calling thread, without the worker threads' handoffs).

Each op also carries the CPU it took of each member (`communication_cpu`: the CPU time of the
rank's other threads, gloo's, while it was in flight, and of the calling thread inside its call or
wait), which the engine charges to the member's core. For the virtual clock (a core per rank;
`median_op_cpu`, passed by virtual.replay_steps) that is the lower median over the run's timed
steps of the same op's CPU on that member, not the one call's: one call's figure has a long tail
that is the machine's, not the op's. With more ranks than cores, or beside another job, gloo's
threads now and then take several times a call's median CPU (docs/virtual-time.md, "What an op's
CPU is"), and since an op lasts at least the CPU its busiest member spent on it, those tails
would lengthen the replayed step by the contention the replay exists to remove.

Waits the log cannot see (PyTorch's own, inside its C++): a post that no wait names is waited for
where the phase it was posted in ends, the rule for DDP, whose reducer waits for its bucket
all-reduces at the end of backward; a message that no wait names (none in this project's
strategies) at the end of the step.
"""

from __future__ import annotations

import math
from collections import defaultdict

from parallel.net.predict import PredictionError, transfers
from parallel.replay.engine import Call, Compute, Op, Post, Wait
from parallel.replay.links import LinkModel

P2P = ("send", "recv")


def algorithm_steps(op: str, n: int) -> int:
    """How many latency-bound steps the algorithm takes on n members (gloo's)."""
    log2 = math.ceil(math.log2(n)) if n > 1 else 0
    return {"all_reduce": 2 * (n - 1), "reduce_scatter": 2 * (n - 1), "all_gather": 2 * (n - 1),
            "all_to_all": n - 1, "broadcast": log2, "broadcast_object": 2 * log2, "gather_object": 1,
            "all_gather_object": 2 * (n - 1), "barrier": 2 * log2, "send": 1, "recv": 1}.get(op, n - 1)


def is_post(span: dict) -> bool:
    return span["kind"] == "post" or (span["kind"] == "call" and span.get("posted", False))


def in_step(rank_step: dict) -> list[dict]:
    """The spans made inside the step (not the loss reduced for the log after it)."""
    end = rank_step["phases"][-1]["end"] if rank_step["phases"] else math.inf
    return [s for s in rank_step["spans"] if s["start"] < end]


def collective_demand(op: str, payload: int, sent: int, members: tuple[int, ...],
                      links: LinkModel) -> tuple[dict, float]:
    """{link: bytes} every member's transfers load, and the op's latency."""
    n = len(members)
    demand: dict = defaultdict(float)
    latency = 0.0
    for i, rank in enumerate(members):
        if op == "gather_object":
            moved = [(0, payload // n)] if i != 0 else []
        elif op in ("broadcast_object", "all_gather_object"):
            moved = [(t.to, t.nbytes * t.count) for t in transfers("broadcast" if op == "broadcast_object"
                                                                    else "all_gather", payload, n, i)]
        else:
            try:
                moved = [(t.to, t.nbytes * t.count) for t in transfers(op, payload, n, i, sent=sent)]
            except PredictionError:  # an op without a rule: its ring bytes to the next member
                moved = [((i + 1) % n, sent)]
        for to, nbytes in moved:
            link, figures = links.edge(rank, members[to])
            demand[link] += nbytes
            latency = max(latency, figures.latency_s)
    if not demand and n > 1:  # a barrier: latency only
        latency = max(links.edge(members[0], members[1])[1].latency_s, 0.0)
    return dict(demand), latency * algorithm_steps(op, n)


def keyed_spans(rank: int, step: dict, groups: dict[str, list[int]]) -> list[tuple[dict, tuple | None]]:
    """A rank's spans of one step in order, each with the key that matches it across ranks (the
    module docstring's rule: the k-th collective on a group, the k-th message from a to b); a wait
    has None."""
    counts: dict[tuple, int] = defaultdict(int)
    mine: list[tuple[dict, tuple | None]] = []
    for s in in_step(step):
        if s["kind"] == "wait":
            mine.append((s, None))
            continue
        if s["op"] in P2P:
            src, dst = (rank, s["peer"]) if s["op"] == "send" else (s["peer"], rank)
            qkey = ("p2p", s["group"], src, dst)
        else:
            qkey = ("coll", s["group"], tuple(groups[s["group"]]))
        key = (*qkey, counts[qkey])
        counts[qkey] += 1
        mine.append((s, key))
    return mine


def _identity(key: tuple, span: dict) -> tuple:
    """What makes two steps' ops the same op: the matching key, and what the call was (a step
    with an extra call on a group shifts the counts after it; those are not the same ops)."""
    return (*key, span["op"], span["tag"], span["payload_bytes"])


def op_cpu_samples(events: list[dict]) -> dict[tuple, list[float]] | None:
    """Every call's CPU on every member over the run's timed steps: {(op identity, rank): the CPU
    of each of that op's calls on that rank} (`communication_cpu`, step by step). None where a
    step was saved without the other threads' clock (nothing to charge)."""
    samples: dict[tuple, list[float]] = defaultdict(list)
    for e in events:
        for step in e["steps"]:
            keyed = keyed_spans(e["rank"], step, e["groups"])
            got = communication_cpu(step, keyed)
            if got is None:
                return None
            span_of = {key: span for span, key in keyed if key is not None}  # one span per key a step
            for key, cpu in got[0].items():
                samples[(_identity(key, span_of[key]), e["rank"])].append(cpu)
    return dict(samples)


def median_op_cpu(events: list[dict]) -> dict[tuple, float] | None:
    """Every op's CPU on every member over the run's timed steps: {(op identity, rank): the lower
    median of that op's CPU on that rank across the steps it appears in}. None where a step was
    saved without the other threads' clock (nothing to charge).

    Why not each call's own figure: the CPU of one call has a long tail that comes from the
    machine, not the op: beside busy processes the tail grows while the median stays
    (docs/virtual-time.md, "What an op's CPU is"); the op's own work is what it takes when nothing
    else intervenes, and most of its calls show that. The lower median, as a run's step is."""
    samples = op_cpu_samples(events)
    if samples is None:
        return None
    return {k: sorted(v)[(len(v) - 1) // 2] for k, v in samples.items()}


def build(rank_steps: list[dict], groups: list[dict[str, list[int]]], links: LinkModel,
          compute_scale: float = 1.0, with_cpu: bool = True, op_cpu: dict[tuple, float] | None = None) -> list[list]:
    """Every rank's program for one step. `rank_steps[r]`: rank r's saved step ({phases, spans});
    `groups[r]`: its groups' members (global ranks); `compute_scale`: compute time is multiplied by it
    (a what-if on another device); `with_cpu`: each op carries the CPU it took of each member
    (`communication_cpu`), which the engine charges to the members' cores (False: a device whose
    communication takes none of its compute, the cluster what-if); `op_cpu`: the run's
    `median_op_cpu`, which then replaces each call's own figure (a member it holds nothing for took
    no CPU for that op in any step: 0, as its own figure would be)."""
    n = len(rank_steps)
    keyed = [keyed_spans(r, step, groups[r]) for r, step in enumerate(rank_steps)]
    by_key: dict[tuple, list[tuple[int, dict]]] = defaultdict(list)
    for r, mine in enumerate(keyed):
        for s, key in mine:
            if key is not None:
                by_key[key].append((r, s))
    ops: dict[tuple, Op] = {}
    for key, posts in by_key.items():
        s = posts[0][1]
        name = f"{s['op']} {s['group']} {s['tag']}"
        if key[0] == "p2p":
            _, group, src, dst, _ = key
            send = next((span for _, span in posts if span["op"] == "send"), s)
            link, figures = links.edge(src, dst)
            payload = send["payload_bytes"]
            ops[key] = Op(key, (src, dst), f"send/recv {group} {send['tag']}",
                          "bubble" if group == "pp" else "exposed_comm", None, figures.message_latency_s,
                          {link: payload} if payload else {})
        else:
            members = key[2]
            payload = max(span["payload_bytes"] for _, span in posts)
            sent = max(int(span["sent_bytes"]) for _, span in posts)
            demand, latency = collective_demand(s["op"], payload, sent, members, links)
            ops[key] = Op(key, members, name, "exposed_comm", key[:3], latency, demand, lanes=links.lanes)
    for key, op in ops.items():
        if len(op.members) < 2 and key[0] == "coll":
            op.latency_s, op.demand = 0.0, {}
    if with_cpu and op_cpu is not None:
        # The run's medians: an op no step charged a member anything for is not in them (0).
        for key, op in ops.items():
            span_of = dict(by_key[key])
            op.cpu = {m: op_cpu.get((_identity(key, span_of[m]), m), 0.0) if m in span_of else 0.0
                      for m in op.members}
    elif with_cpu:
        spent = [communication_cpu(rank_steps[r], keyed[r]) for r in range(n)]
        for key, op in ops.items():
            if all(spent[m] is not None for m in op.members):
                op.cpu = {m: spent[m][0].get(key, 0.0) for m in op.members}
    return [_program(r, rank_steps[r], keyed[r], ops, compute_scale) for r in range(n)]


def _weight(span: dict) -> float:
    return float(max(span["payload_bytes"], 1))


def communication_cpu(step: dict, keyed: list[tuple]) -> tuple[dict, float] | None:
    """What each op took of the rank's CPU: ({op key: seconds}, seconds left unattributed); None
    for a step saved without the other threads' clock.

    Two parts. The CPU time of the rank's other threads (gloo's: the event loop that moves the
    bytes, the workers that reduce them) between two stamps of the step goes to the ops in flight
    between them, in proportion to their payload bytes; an op is in flight from its post (or call)
    to the end of the wait that names it (a blocking call: to its own end; a post no wait names: to
    the end of the phase it waits at, the module docstring's rule). CPU time they spent while no op
    was in flight is left unattributed and returned beside. And the compute thread's own CPU time
    inside a blocking call or a wait (gloo sends and receives on the calling thread): the call's op
    or the ops the wait names."""
    phases = step["phases"]
    if any("helper_start" not in x for x in [*phases, *(s for s, _ in keyed)]):
        return None
    if not phases:
        return {}, 0.0
    spent = _calling_thread_cpu(keyed)
    unattributed = _share_other_threads_cpu(phases, keyed, _lifetimes(phases, keyed), spent)
    return {k: max(0.0, v) for k, v in spent.items()}, max(0.0, unattributed)


def _calling_thread_cpu(keyed: list[tuple]) -> dict[tuple, float]:
    """The compute thread's CPU inside each blocking call (its op's) and each wait (shared by the
    ops it names, in proportion to their payload bytes)."""
    spent: dict[tuple, float] = defaultdict(float)
    weight_of_id = {s["id"]: (key, _weight(s)) for s, key in keyed if key is not None}
    for s, key in keyed:
        if key is not None and not is_post(s):
            spent[key] += max(0.0, s["cpu_end"] - s["cpu_start"])
    for s, key in keyed:
        if key is None:
            named = [weight_of_id[w] for w in s.get("waits", ()) if w in weight_of_id]
            total = sum(w for _, w in named)
            for k, w in named:
                spent[k] += max(0.0, s["cpu_end"] - s["cpu_start"]) * w / total
    return spent


def _lifetimes(phases: list[dict], keyed: list[tuple]) -> dict[tuple, tuple[float, float, float]]:
    """Each op's time in flight and weight: key -> (start, end, payload bytes). A blocking call
    flies to its own end; a post to the end of the wait that names it, else (a post no wait names)
    to the start of the phase it waits at, or the step's end (a message)."""
    step_end = phases[-1]["end"]
    ends_of = defaultdict(float)
    for s, _ in keyed:
        if s["kind"] == "wait":
            for w in s.get("waits", ()):
                ends_of[w] = max(ends_of[w], s["end"])
    life = {}
    for s, key in keyed:
        if key is None:
            continue
        if not is_post(s):
            end = s["end"]
        elif s["id"] in ends_of:
            end = ends_of[s["id"]]
        elif key[0] == "p2p":
            end = step_end
        else:
            later = _implicit_wait_phase(phases, s)
            end = later["start"] if later else step_end
        life[key] = (s["start"], max(end, s["start"]), _weight(s))
    return life


def _share_other_threads_cpu(phases: list[dict], keyed: list[tuple], life: dict, spent: dict) -> float:
    """Add to `spent` the other threads' CPU between each two stamps of the step, shared by the ops
    in flight then in proportion to their payload bytes; return what fell while none was."""
    marked = [*phases, *(x for x, _ in keyed)]
    stamps = sorted({(x["start"], x["helper_start"]) for x in marked} | {(x["end"], x["helper_end"]) for x in marked})
    unattributed = 0.0
    for (t0, h0), (t1, h1) in zip(stamps, stamps[1:]):
        # Signed: the clock's two reads are not one atomic sample, and it may step back a little
        # between stamps, a scheduler tick on a busy machine (timing.cpu_stamp); summed, the steps
        # cancel.
        gained = h1 - h0
        middle = (t0 + t1) / 2
        flying = [(k, w) for k, (a, b, w) in life.items() if a <= middle <= b]
        total = sum(w for _, w in flying)
        if not flying:
            unattributed += gained
        for k, w in flying:
            spent[k] += gained * w / total
    return unattributed


def _program(rank: int, step: dict, keyed: list[tuple], ops: dict, scale: float) -> list:
    phases = step["phases"]
    if not phases:
        raise ValueError(f"rank {rank}: the step has no phases (run without a clock): nothing to replay")
    end_cpu = phases[-1]["cpu_end"]
    waited = {w for s, _ in keyed if s["kind"] == "wait" for w in s.get("waits", ())}
    handle_of = {s["id"]: key for s, key in keyed if key is not None}
    # Implicit waits (module docstring): cpu point -> handles
    implicit: list[tuple[float, list]] = []
    for s, key in keyed:
        if key is None or not is_post(s) or s["id"] in waited:
            continue
        if key[0] == "p2p":
            implicit.append((end_cpu, [s["id"]]))
            continue
        later = _implicit_wait_phase(phases, s)
        implicit.append((later["cpu_start"] if later else end_cpu, [s["id"]]))
    implicit.sort(key=lambda x: x[0])
    program: list = []
    cursor = phases[0]["cpu_start"]

    def compute_to(point: float) -> None:
        nonlocal cursor
        while cursor < point:
            i = _phase_at(phases, cursor)
            stop = min(point, phases[i]["cpu_end"]) if i < len(phases) - 1 else point
            if stop <= cursor:  # a phase of no CPU time: step past it
                stop = point if i == len(phases) - 1 else max(stop, phases[i + 1]["cpu_start"])
            program.append(Compute((stop - cursor) * scale, phases[i]["phase"], phases[i]["label"]))
            cursor = stop

    def flush_implicit(upto: float) -> None:
        while implicit and implicit[0][0] <= upto:
            point, ids = implicit.pop(0)
            compute_to(point)
            program.append(Wait(tuple(ids), "", phases[_phase_at(phases, max(cursor - 1e-12, 0))]["phase"]))

    for s, key in keyed:
        flush_implicit(s["cpu_start"])
        compute_to(s["cpu_start"])
        phase = phases[_phase_at(phases, s["cpu_start"])]["phase"]
        if s["kind"] == "wait":
            names = tuple(w for w in s.get("waits", ()) if w in handle_of)
            program.append(Wait(names, f"wait {s['op']} {s['group']} {s['tag']}", phase))
            cursor = max(cursor, s["cpu_end"])
        elif is_post(s):
            program.append(Post(ops[key], s["id"], phase))
        else:
            program.append(Call(ops[key], phase))
            cursor = max(cursor, s["cpu_end"])
    flush_implicit(math.inf)
    compute_to(end_cpu)
    return program


def _implicit_wait_phase(phases: list[dict], post: dict) -> dict | None:
    """The phase at whose start a collective's post that no wait names is waited for: the first
    after the phase it was posted in (DDP's reducer waits at the end of backward); None: the step's
    end."""
    i = _phase_at(phases, post["cpu_start"])
    return next((p for p in phases[i + 1:] if p["phase"] != phases[i]["phase"]), None)


def _phase_at(phases: list[dict], cpu: float) -> int:
    """The index of the phase whose CPU interval holds `cpu` (the last one from its end on)."""
    for i, p in enumerate(phases):
        if cpu < p["cpu_end"]:
            return i
    return len(phases) - 1
