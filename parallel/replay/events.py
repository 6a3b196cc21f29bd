"""The events every rank keeps of its timed steps, saved in the run directory for the replay.

Per rank, events/rank<r>.json:

    rank, coords, node      the global rank, its coordinates, the node it ran on
    machine, cores          the machine it shared cores with (parallel/dist/binding.py's machine id)
                            and the cores it could run on once bound (`train.pin_cores`): one core
                            where the run bound it, the machine's usable cores where it did not
    threads                 its intra-op threads (torch.get_num_threads()): its virtual device's cores,
                            and the clock the replay reads its compute on (device.py)
    groups                  {group name: its members' global ranks, in group-rank order}
    steps                   per timed step: step, wall_s (the rank's step time), cpu_s (its thread's
                            CPU time in the step), phases [{phase, label, start, end, cpu_start,
                            cpu_end, helper_start, helper_end}], spans [{kind, op, group, tag,
                            payload_bytes, sent_bytes, start, end, cpu_start, cpu_end,
                            helper_start, helper_end, id, peer, waits, posted}]

Times are seconds from the rank's step start, on each clock: wall (start, end), the compute
thread's CPU time (cpu_*), the CPU time of the process's other threads, gloo's (helper_*; runs
saved before it was recorded have none, and are replayed without it). This is everything the replay
reads: `python -m launch.replay <run dir>` replays a run later, on other links, without rerunning.
"""

from __future__ import annotations

import json
from pathlib import Path

SPAN_FIELDS = ("kind", "op", "group", "tag", "payload_bytes", "sent_bytes", "start", "end", "cpu_start", "cpu_end",
               "helper_start", "helper_end", "id", "peer", "waits", "posted")
DIRECTORY = "events"


def step_record(step: int, wall_s: float, cpu_s: float, phases: list[dict], spans: list[dict]) -> dict:
    return {"step": step, "wall_s": wall_s, "cpu_s": cpu_s, "phases": phases,
            "spans": [{k: s[k] for k in SPAN_FIELDS} for s in spans]}


def save(run_dir: Path, rank_events: list[dict]) -> str:
    out = Path(run_dir) / DIRECTORY
    out.mkdir(parents=True, exist_ok=True)
    for e in rank_events:
        (out / f"rank{e['rank']}.json").write_text(json.dumps(e, separators=(",", ":")))
    return DIRECTORY


def load(run_dir: Path) -> list[dict]:
    """Every rank's events, in rank order."""
    files = sorted((Path(run_dir) / DIRECTORY).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"{run_dir} has no {DIRECTORY}/rank*.json: run it again with this version "
                                "(every run saves its timed steps' events there)")
    return [json.loads(p.read_text()) for p in files]


def placement(events: list[dict]) -> list[tuple] | None:
    """The core each rank was bound to, as (machine, core), where the run bound every rank to one
    core (`train.pin_cores=round_robin`, or `auto` with a core per rank): the replay's `cores` for
    reproducing that machine, its ranks sharing their cores. None where a rank was not bound to a
    single core (the kernel moved its threads) or the run was saved before the cores were recorded."""
    if any(len(e.get("cores") or []) != 1 for e in events):
        return None
    return [(e.get("machine"), e["cores"][0]) for e in events]
