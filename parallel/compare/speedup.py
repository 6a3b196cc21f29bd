"""Each row's speed-up over `single`, and the guard that keeps the clock from making one.

`speedup_vs_single` is a row's tokens/s over the `single` row's of the same round, on the clock
that leads the sweep (parallel/compare/clock.py). On the wall clock both rows ran on this machine.
In virtual time each rank has a device of its own (parallel/replay/device.py): a core per intra-op
thread. A ratio of two virtual steps is then a ratio per device, and says what the strategy does
only where the two rows' ranks had the same device: a world-4 row of one core per rank against a
`single` of two cores on the wall clock would count cores, not ranks (and a clock that summed two
threads' CPU would make `single` slower than one core, and a world-4 row more than four times
faster). So:

    devices differ      no speed-up (None); `speedup_note` names both devices and clocks. The
                        sweep avoids it by running one thread per rank in virtual time;
                        `train.threads` given to the sweep can bring it back
    above the ranks     a speed-up above the row's rank count on one device and one clock does
                        not come from the clock: it is kept, and `speedup_note` says so (a rank's
                        compute per token is below single's: its smaller batch, its caches)

Rows with either note are named in report.md's caveats (verdict.py).
"""

from __future__ import annotations

from parallel.registry import SINGLE

WITHHELD, ABOVE_RANKS = "withheld", "above its ranks"


def device_words(row: dict) -> str:
    cores, clock = row.get("virtual_cores_per_rank"), row.get("virtual_compute_clock")
    if cores is None:
        return "a device per rank not stated"
    on = "the wall clock" if clock == "wall" else "thread CPU time"
    return f"{cores} core{'s' if cores != 1 else ''} per rank on {on}"


def speedup_over(row: dict, single: dict) -> tuple[float | None, str]:
    """(row's tokens/s over single's, a note: '' where nothing is to be said)."""
    if row is single:
        return 1.0, ""
    if row["clock"] != single["clock"]:
        return None, (f"{WITHHELD}: single ranked on {single['clock']}, {row['strategy']} on {row['clock']}: "
                      "two clocks, no ratio")
    virtual = row["clock"] == "virtual"
    if virtual and device_words(row) != device_words(single):
        return None, (f"{WITHHELD}: in virtual time single has {device_words(single)}, {row['strategy']} "
                      f"{device_words(row)}: the ratio would count the cores each clock gives, not the strategy "
                      "(the sweep gives every run one thread per rank in virtual time unless train.threads is set)")
    ratio = row["tokens_per_s"] / single["tokens_per_s"]
    if ratio <= row["world"]:
        return ratio, ""
    clock = f"virtual time, {device_words(row)}" if virtual else "the wall clock, on this machine"
    return ratio, (f"{ABOVE_RANKS}: {ratio:.2f}x single with {row['world']} ranks, both on {clock}: not the "
                   "clock's doing; a rank computes less per token than single does (its compute_ms)")


def add_speedups(rows: list[dict]) -> None:
    """Set `speedup_vs_single` and `speedup_note` on every row that ran, against the round's
    `single` row (none swept or ran: every row's speed-up stays None)."""
    ran = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    single = next((r for r in ran if r["runs_as"] == SINGLE.name), None)
    if single is None:
        return
    for row in ran:
        row["speedup_vs_single"], row["speedup_note"] = speedup_over(row, single)
