"""The straggler score on known compute times, and its options and train.fail_mode=slow refused by name."""

import pytest
from test_layout import plan_for

from parallel.dist.dims import ParallelDims
from parallel.reliability.straggler import StragglerMeter, straggler_scores
from parallel.run_plan import ConfigError


def test_a_rank_twice_as_slow_as_its_peers_scores_two():
    window = [[1.0, 1.0, 2.0, 1.1], [1.0, 0.9, 2.0, 1.0]]
    scores = straggler_scores(window, [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    assert scores[2] == pytest.approx(4.0 / 2.0)  # its peers' totals 2.0, 1.9, 2.1: median 2.0
    assert scores[0] == pytest.approx(2.0 / 2.1)  # peers 1.9, 4.0, 2.1: median 2.1


def test_the_median_of_the_peers_is_not_moved_by_the_straggler_itself():
    """At world 4 one slow rank is one of the three peers of each other rank: the median ignores it."""
    scores = straggler_scores([[1.0, 1.0, 3.0, 1.0]], [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    assert scores == [1.0, 1.0, 3.0, 1.0]


def test_pipeline_stages_are_not_compared_and_a_rank_without_peers_has_no_score():
    """dp 2 x pp 2: rank r's peer is the rank of its own stage; pp 2 alone: no peers, no score."""
    meter = StragglerMeter(None, ParallelDims(world_size=4, dp=2, pp=2), 0, 5, 1.5)
    stage = {r: ParallelDims(world_size=4, dp=2, pp=2).coordinates(r)["pp"] for r in range(4)}
    assert all(len(p) == 1 and stage[p[0]] == stage[r] for r, p in enumerate(meter.peers))
    assert straggler_scores([[1.0, 5.0]], [[], []]) == [None, None]
    assert meter.step(0, 1.0) == {} and meter.summary() is None  # one process: nothing to compare


@pytest.mark.parametrize("overrides,words", [
    (["train.straggler_window=0"], "train.straggler_window=0 must be a number of steps"),
    (["train.straggler_threshold=1.0"], "train.straggler_threshold=1.0 must be a score above 1"),
    (["train.fail_mode=slow", "train.fail_at_step=1", "train.slow_factor=0.5"],
     "train.slow_factor=0.5 must be a number above 1"),
])
def test_bad_straggler_and_slow_options_are_refused_by_name(overrides, words):
    with pytest.raises(ConfigError, match=words):
        plan_for(2, "model=tiny", "parallel=dp", "train.steps=6", *overrides)


def test_a_slow_rank_is_a_valid_fault():
    plan = plan_for(2, "model=tiny", "parallel=dp", "train.steps=6", "train.fail_mode=slow", "train.fail_at_step=2",
                    "train.fail_rank=1", "train.slow_factor=3")
    assert (plan.fail_mode, plan.slow_factor, plan.straggler_window, plan.straggler_threshold) == ("slow", 3.0, 5, 1.5)
