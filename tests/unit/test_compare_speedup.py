"""The sweep's speed-up over `single` (parallel/compare/speedup.py), on rows whose virtual blocks
are given: in virtual time a speed-up is a ratio per device, withheld where the two rows' ranks
had different devices, and one above the row's ranks on one device is flagged as not the clock's.
And the sweep's one thread per rank in virtual time (clock.one_thread_per_rank)."""

from __future__ import annotations

import pytest

from parallel.compare.clock import apply, one_thread_per_rank
from parallel.compare.report import markdown_table
from parallel.compare.rows import COLUMNS
from parallel.compare.speedup import add_speedups
from parallel.compare.verdict import caveats

ONE_CORE = {"cores": 1, "intra_op_threads": 1, "compute_clock": "thread_cpu"}
TWO_CORES_WALL = {"cores": 2, "intra_op_threads": 2, "compute_clock": "wall"}


def row(strategy: str, world: int, virtual_step_s: float, device: dict, clock: str = "virtual",
        wall_step_s: float = 1.0) -> dict:
    """A row that ran, its figures on `clock`, from a virtual block of `virtual_step_s` on `device`."""
    r = dict.fromkeys(COLUMNS)
    r.update(strategy=strategy, runs_as=strategy, status="ok", world=world, layout=f"{world}x1x1 m1",
             tokens_per_s=1000 / wall_step_s, step_ms=wall_step_s * 1e3, bubble_share=None)
    virtual = {"step_time_s": virtual_step_s, "tokens_per_s": 1000 / virtual_step_s, "mfu": {"mfu": 0.1},
               "time_breakdown_s": {"compute": virtual_step_s}, "step_times_s": [virtual_step_s],
               "device_per_rank": device}
    return apply(r, {"virtual": virtual}, clock)


def test_one_core_per_rank_on_both_sides_gives_the_ratio_per_core():
    rows = [row("single", 1, 0.8, ONE_CORE), row("dp", 4, 0.25, ONE_CORE)]
    add_speedups(rows)
    assert rows[0]["speedup_vs_single"] == 1.0
    assert rows[1]["speedup_vs_single"] == pytest.approx(3.2) and rows[1]["speedup_note"] == ""
    assert (rows[1]["virtual_cores_per_rank"], rows[1]["virtual_compute_clock"]) == (1, "thread_cpu")


def test_a_single_of_two_cores_against_ranks_of_one_is_withheld_naming_both_clocks():
    rows = [row("single", 1, 0.4, TWO_CORES_WALL), row("dp", 4, 0.1, ONE_CORE)]
    add_speedups(rows)
    assert rows[1]["speedup_vs_single"] is None
    note = rows[1]["speedup_note"]
    assert note.startswith("withheld") and "single has 2 cores per rank on the wall clock" in note
    assert "dp 1 core per rank on thread CPU time" in note
    assert "Speed-up over single: dp (withheld" in " ".join(caveats(rows, {}))
    # On the wall clock both rows ran on this machine: the ratio stands whatever each rank's threads.
    walled = [row("single", 1, 0.4, TWO_CORES_WALL, "wall", 0.4), row("dp", 4, 0.1, ONE_CORE, "wall", 0.2)]
    add_speedups(walled)
    assert walled[1]["speedup_vs_single"] == pytest.approx(2.0) and walled[1]["speedup_note"] == ""


def test_a_speed_up_above_the_ranks_on_one_device_is_kept_and_flagged_as_not_the_clocks():
    rows = [row("single", 1, 1.0, ONE_CORE), row("dp", 4, 0.2, ONE_CORE), row("tp", 2, 0.5, ONE_CORE)]
    add_speedups(rows)
    assert rows[1]["speedup_vs_single"] == pytest.approx(5.0)
    assert rows[1]["speedup_note"].startswith("above its ranks: 5.00x single with 4 ranks, both on virtual time, "
                                              "1 core per rank on thread CPU time: not the clock's doing")
    assert rows[2]["speedup_note"] == ""
    lines = markdown_table(rows).splitlines()
    assert "| x single |" in lines[0]
    assert "| 5.00! |" in lines[3] and "| 2.00 |" in lines[4]


def test_rows_on_different_clocks_or_without_a_single_row_get_no_speed_up():
    rows = [row("single", 1, 1.0, ONE_CORE), row("dp", 4, 0.25, ONE_CORE)]
    rows[1]["clock"] = "wall (no virtual block)"
    add_speedups(rows)
    assert rows[1]["speedup_vs_single"] is None and rows[1]["speedup_note"].startswith("withheld")
    alone = [row("dp", 4, 0.25, ONE_CORE)]
    add_speedups(alone)
    assert alone[0]["speedup_vs_single"] is None and alone[0]["speedup_note"] is None


def test_the_sweep_runs_one_thread_per_rank_in_virtual_time_unless_train_threads_is_given():
    common = ["model=small", "train.steps=5", "train.threads=null", "run.timeline=false"]
    assert one_thread_per_rank(common, "virtual") == ["model=small", "train.steps=5", "train.threads=1",
                                                      "run.timeline=false"]
    assert one_thread_per_rank(common, "wall") == common
    given = ["model=small", "train.threads=2"]
    assert one_thread_per_rank(given, "virtual") == given
