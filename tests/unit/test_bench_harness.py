"""bench/harness.py's statistics on figures with known answers: each variant's median, its interval
(the lowest and highest round's median) and the ratio of two variants round by round; the variants'
order in each round; the benchmark's own options apart from the training config's overrides."""

from __future__ import annotations

import importlib

import pytest
from launcher import PROJECT_ROOT


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))
    return importlib.import_module("bench.harness")


def test_a_variants_median_and_interval_come_from_its_rounds(harness):
    timings = harness.Timings(["ours", "theirs"], steps=2)
    # Three rounds of two timed steps each: round medians 1.5, 3.5 and 2.0.
    timings.seconds["ours"] = [1.0, 2.0, 3.0, 4.0, 2.0, 2.0]
    assert timings.median("ours") == 2.0
    assert timings.rounds("ours") == [1.5, 3.5, 2.0]
    assert timings.interval("ours") == (1.5, 3.5)
    assert timings.measured() == ["ours"]


def test_the_ratio_is_theirs_step_over_ours_overall_and_round_by_round(harness):
    timings = harness.Timings(["ours", "theirs"], steps=1)
    timings.seconds["ours"] = [1.0, 2.0, 4.0]
    timings.seconds["theirs"] = [2.0, 3.0, 4.0]
    ratio = timings.ratio("ours", "theirs")
    # Medians 2.0 and 3.0; round by round 2.0, 1.5 and 1.0.
    assert (ratio.median, ratio.low, ratio.high) == (1.5, 1.0, 2.0)
    assert str(ratio) == "1.500 (rounds 1.000-2.000)"


def test_each_round_starts_with_the_next_variant(harness):
    names = ["a", "b", "c"]
    assert [harness.rotation(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                             ["a", "b", "c"]]


def test_the_benchmarks_options_are_split_from_the_training_overrides(harness):
    overrides, opts = harness.split_args(["rounds=3", "model=tiny", "parallel.bucket_mb=6"],
                                         {"rounds": "5", "steps": "4"})
    assert overrides == ["model=tiny", "parallel.bucket_mb=6"]
    assert opts == {"rounds": "3", "steps": "4"}


def test_lower_median_and_largest_deviation(harness):
    assert harness.lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert harness.max_dev([90.0, 100.0, 120.0]) == pytest.approx(0.2)
