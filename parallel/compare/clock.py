"""Which clock the sweep leads with: wall time, or virtual device time (parallel/replay/).

`compare.clock`:
    auto     virtual when a run has more ranks than this machine has cores (the wall clock then
             measures ranks taking turns on a core, not the strategies); wall on a GPU, or with a
             core per rank
    wall     the wall clock, always
    virtual  virtual time, always (each run's `virtual` block)

With virtual leading, a row's tokens/s, step, MFU and breakdown columns are the virtual ones, so
that the ranking, the ratios to PyTorch and the "what each strategy waits on" sentences are in
virtual time; the wall figures stay beside them (wall_tokens_per_s, wall_step_ms), and the
virtual ones are always there too (virtual_tokens_per_s, virtual_step_ms). exposed_comm_share
stays the communication log's measured share (None where PyTorch waits out of its sight); the
virtual exposed communication is in exposed_comm_ms.

A rank's virtual device is a core per intra-op thread (parallel/replay/device.py), so with virtual
leading every run of the sweep computes on one thread per rank (`one_thread_per_rank`, unless
train.threads is given): `single` is one core, a world-4 row four, and a speed-up over `single`
is per core (parallel/compare/speedup.py). Each row says what its ranks had
(virtual_cores_per_rank, virtual_compute_clock).
"""

from __future__ import annotations

CLOCKS = ("auto", "wall", "virtual")


class ClockError(ValueError):
    pass


def leading_clock(setting: str, device_type: str, max_world: int, cores: int) -> str:
    if setting not in CLOCKS:
        raise ClockError(f"compare.clock={setting!r}: choose one of {', '.join(CLOCKS)}")
    if setting != "auto":
        return setting
    return "virtual" if device_type == "cpu" and max_world > cores else "wall"


def one_thread_per_rank(overrides: list[str], clock: str) -> list[str]:
    """The runs' overrides with train.threads=1 where virtual time leads and train.threads is unset
    (the sweep passes every train field, an unset one as `train.threads=null`)."""
    if clock != "virtual":
        return overrides
    return ["train.threads=1" if o == "train.threads=null" else o for o in overrides]


def sentence(clock: str, setting: str, max_world: int, cores: int) -> str:
    if clock == "virtual":
        why = (f"{max_world} ranks on {cores} cores: the wall clock measures the machine" if setting == "auto"
               else "compare.clock=virtual")
        return (f"Ranked in virtual time (a device per rank, docs/virtual-time.md; {why}): every run computes on "
                "one thread per rank unless train.threads says otherwise, so a rank's device is one core and "
                "its compute the thread's CPU time; wall time beside it in wall_tokens_per_s and wall_step_ms.")
    return "Ranked in wall time" + (" (a core per rank, or a GPU)." if setting == "auto" else " (compare.clock=wall).")


def apply(row: dict, summary: dict | None, clock: str) -> dict:
    """The row with the leading clock's figures in its main columns, the other clock's beside."""
    virtual = (summary or {}).get("virtual") or {}
    ok = "step_time_s" in virtual
    row["wall_tokens_per_s"], row["wall_step_ms"] = row.get("tokens_per_s"), row.get("step_ms")
    row["wall_bubble_share"] = row.get("bubble_share")
    row["virtual_tokens_per_s"] = virtual["tokens_per_s"] if ok else None
    row["virtual_step_ms"] = virtual["step_time_s"] * 1e3 if ok else None
    row["clock"] = clock if ok or clock == "wall" else "wall (no virtual block)"
    device = virtual.get("device_per_rank")
    if isinstance(device, dict):
        row["virtual_cores_per_rank"], row["virtual_compute_clock"] = device["cores"], device["compute_clock"]
    elif device:  # the ranks' devices differ
        row["virtual_cores_per_rank"], row["virtual_compute_clock"] = None, "differs by rank"
    if clock != "virtual" or not ok:
        return row
    row["tokens_per_s"], row["step_ms"] = virtual["tokens_per_s"], virtual["step_time_s"] * 1e3
    row["mfu"] = virtual["mfu"]["mfu"]
    for part, seconds in virtual["time_breakdown_s"].items():
        row[f"{part}_ms"] = seconds * 1e3
    if (virtual.get("pipeline") or {}).get("bubble") is not None:
        row["bubble_share"] = virtual["pipeline"]["bubble"]
    times = virtual["step_times_s"]
    row.update(step_ms_min=min(times) * 1e3, step_ms_max=max(times) * 1e3,
               spread=(max(times) - min(times)) / virtual["step_time_s"] if len(times) > 1 else None)
    row["noisy"] = row["spread"] is not None and row["spread"] > 0.25
    row["oversubscribed"] = False  # a device per rank, by construction
    return row
