"""What a rank's virtual device is: the cores it computes on, and the clock its compute is read on.

The virtual clock gives every rank a device of its own. On the CPU that device is the cores the
rank computes on, one per intra-op thread (`train.threads`, saved in its events), and its compute
is read on the clock that says what those cores took:

    one thread    the compute thread's CPU time (dist/timing.py): one core's time, which does not
                  advance while the thread waits for a core or blocks in a call, so the contention
                  of a machine with fewer cores than ranks is not in it
    several       the wall clock: the time the rank's cores took together, as the rank had them

No CPU clock is the second. The sum of several intra-op threads' CPU times is neither one core's
time nor several's: each thread that finishes its share of a matmul first spins at the end of the
parallel region until the last is done, and spins the longer when a sibling waits for a core, so
the sum grows with the machine's load. The wall clock of a rank's compute is its cores' time where
the rank had them to itself (the binding gives each rank a block of `threads` cores where the
machine has them, dist/binding.py), and says so nowhere else.

So a rank with several threads is replayed on its wall stamps (`replayed_step`): its compute is
the wall time between its calls, its communication is timed by the link model as every rank's is,
and the CPU its gloo threads took is not charged again: its compute's wall time already holds
what they took of its cores. A virtual speed-up is per core only between rows of one device: the
sweep runs one thread per rank when it ranks in virtual time (parallel/compare/clock.py), and
withholds a speed-up over `single` between devices that differ (parallel/compare/speedup.py).

Runs saved before the threads were recorded are replayed as they were saved: on their CPU stamps.
"""

from __future__ import annotations

from dataclasses import dataclass

THREAD_CPU, WALL = "thread_cpu", "wall"
CLOCK_WORDS = {THREAD_CPU: "the compute thread's CPU time", WALL: "the wall clock"}
STAMPS = (("start", "cpu_start"), ("end", "cpu_end"))


@dataclass(frozen=True)
class Device:
    """A rank's virtual device: `cores` (one per intra-op thread) and the clock of its compute."""

    cores: int
    clock: str

    def describe(self) -> str:
        return f"{self.cores} core{'s' if self.cores != 1 else ''}, compute on {CLOCK_WORDS[self.clock]}"

    def as_dict(self) -> dict:
        return {"cores": self.cores, "intra_op_threads": self.cores, "compute_clock": self.clock,
                "in_words": self.describe()}


def device_of(rank_events: dict) -> Device:
    """The device of the rank whose saved events these are (module docstring)."""
    threads = int(rank_events.get("threads") or 1)
    return Device(threads, THREAD_CPU if threads == 1 else WALL)


def replayed_step(rank_events: dict, index: int) -> dict:
    """Step `index` of the rank as the replay reads it: as saved for one thread; for several, its
    CPU stamps replaced by its wall stamps and the other threads' clock left out (those threads
    are its own intra-op threads as well as gloo's, and the wall clock holds what they took)."""
    step = rank_events["steps"][index]
    if device_of(rank_events).clock == THREAD_CPU:
        return step
    return {**step, "cpu_s": step["wall_s"], "phases": [_on_wall(p) for p in step["phases"]],
            "spans": [_on_wall(s) for s in step["spans"]]}


def as_replayed(events: list[dict]) -> list[dict]:
    """Every rank's events with every step as the replay reads it (`replayed_step`)."""
    return [{**e, "steps": [replayed_step(e, i) for i in range(len(e["steps"]))]} for e in events]


def _on_wall(record: dict) -> dict:
    wall = {k: v for k, v in record.items() if not k.startswith("helper_")}
    for wall_key, cpu_key in STAMPS:
        wall[cpu_key] = record[wall_key]
    return wall


def run_device(events: list[dict]) -> dict | list[dict]:
    """The block's `device_per_rank`: the one device every rank had, or each rank's where they differ."""
    devices = [device_of(e) for e in events]
    if len(set(devices)) == 1:
        return devices[0].as_dict()
    return [d.as_dict() for d in devices]


def cores_per_rank(events: list[dict]) -> float:
    """A rank's cores, for its device's peak: the mean over the ranks, so that where they differ
    the ranks' peaks still add up to their cores'."""
    return sum(device_of(e).cores for e in events) / len(events)
