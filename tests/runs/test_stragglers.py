"""A slowed rank is flagged, a clean run flags none (parallel/reliability/straggler.py).

One run of 30 steps at world 2: steps 0-19 clean, then rank 1's compute takes train.slow_factor=2
times as long (train.fail_mode=slow spins, so that the score's clock, the training thread's CPU
time, sees it). The 100-step clean runs at world 4 are bench/straggler_scores.py's.
"""

import json

from launcher import TINY, assert_ok, run_train

SLOW_AT, STEPS, FACTOR = 20, 30, 2.0


def test_a_slowed_rank_is_flagged_with_its_factor_and_clean_steps_flag_none(tmp_path):
    run = run_train(2, [*TINY, "parallel=dp", f"train.steps={STEPS}", "train.global_batch=4", "train.fail_mode=slow",
                        f"train.fail_at_step={SLOW_AT}", "train.fail_rank=1", f"train.slow_factor={FACTOR}"],
                    tmp_path / "run")
    summary = assert_ok(run)
    metrics = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    clean, slowed = metrics[:SLOW_AT], metrics[SLOW_AT:]
    assert all(m["stragglers"] == [] for m in clean), [m["straggler_scores"] for m in clean]
    flagged = [m["step"] for m in slowed if m["stragglers"] == [1]]
    assert flagged and flagged[0] < SLOW_AT + 10 and flagged == list(range(flagged[0], STEPS)), flagged
    # Once the window (5 steps) holds slowed steps only, the score is the factor, within 10%.
    last = slowed[-1]["straggler_scores"][1]
    assert abs(last - FACTOR) <= 0.1 * FACTOR, last
    assert f"straggler at step {flagged[0]}: rank 1 score" in run.stdout
    stragglers = summary["stragglers"]
    assert stragglers["first_flagged_step"] == {"1": flagged[0]} and stragglers["window"] == 5
    assert "thread CPU time" in stragglers["clock"]
    assert not (run.run_dir / "flight").exists()  # no hang, no flight-recorder dumps
