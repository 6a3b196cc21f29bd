"""Goodput: the Young/Daly model (limits and optimum), chaos mode's seeded draw and options, and
the measured report from a job log (parts that add up, a step run twice counted once)."""

import math

import pytest
from test_layout import plan_for

from parallel.reliability.chaos import draw
from parallel.reliability.goodput import (
    GoodputInputs,
    daly_goodput,
    daly_interval,
    first_order_goodput,
    predict,
    with_startup,
    young_interval,
)
from parallel.reliability.goodput_report import PARTS, goodput_block, journal_faults, measure
from parallel.run_plan import ConfigError


# -- the model --------------------------------------------------------------------------------------
def test_no_failures_and_free_saves_give_full_goodput():
    assert first_order_goodput(10.0, 0.0, 5.0, math.inf) == 1.0
    assert daly_goodput(10.0, 0.0, 0.0, 1e12) == pytest.approx(1.0, abs=1e-9)


def test_first_order_is_daly_when_everything_is_small():
    tau, delta, restart, mtbf = 10.0, 0.01, 3.0, 1e5  # delta small beside tau too: delta/(tau + delta) ~ delta/tau
    loss_first = 1 - first_order_goodput(tau, delta, restart, mtbf)
    loss_daly = 1 - daly_goodput(tau, delta, restart, mtbf)
    assert loss_daly == pytest.approx(loss_first, rel=0.02)


def test_each_term_costs_what_the_formula_says():
    # Saves only (no failures): delta/tau; failures only: (tau/2 + R)/M.
    assert first_order_goodput(4.0, 1.0, 0.0, 1e300) == pytest.approx(0.75)
    assert first_order_goodput(20.0, 0.0, 10.0, 100.0) == pytest.approx(1 - 20 / 100)


def test_goodput_is_floored_at_zero_and_refuses_nonsense():
    assert first_order_goodput(1000.0, 1.0, 50.0, 100.0) == 0.0
    assert daly_goodput(1e6, 1.0, 0.0, 10.0) == 0.0
    with pytest.raises(ValueError):
        first_order_goodput(0.0, 1.0, 1.0, 10.0)


@pytest.mark.parametrize("delta,mtbf", [(0.2, 90.0), (1.0, 3600.0), (30.0, 86400.0)])
def test_the_optima_maximise_their_models(delta, mtbf):
    grid = [young_interval(delta, mtbf) * f for f in (0.5 + 0.001 * i for i in range(1001))]
    best_first = max(grid, key=lambda tau: first_order_goodput(tau, delta, 0.0, mtbf))
    assert best_first == pytest.approx(young_interval(delta, mtbf), rel=2e-3)
    best_daly = max(grid, key=lambda tau: daly_goodput(tau, delta, 0.0, mtbf))
    # Daly's sqrt(2 delta M) - delta is itself first order in sqrt(delta/M).
    assert best_daly == pytest.approx(daly_interval(delta, mtbf), rel=0.05)


def test_a_one_time_start_up_weighs_on_a_short_job_only():
    assert with_startup(0.8, 0.0, 100.0) == pytest.approx(0.8)
    assert with_startup(0.8, 5.0, 100.0) == pytest.approx(100 / (5 + 125))
    assert with_startup(0.8, 5.0, 1e7) == pytest.approx(0.8, rel=1e-5)
    assert with_startup(0.0, 5.0, 100.0) == 0.0


def test_daly_interval_past_two_m_is_m():
    assert daly_interval(300.0, 100.0) == 100.0


def test_predict_names_its_inputs_and_the_best_steps():
    inputs = GoodputInputs(step_s=0.05, steps_per_checkpoint=100, save_s=0.2, restart_s=6.0, mtbf_s=90.0)
    got = predict(inputs)
    assert got["inputs"]["interval_s"] == pytest.approx(5.0)
    assert got["first_order"] == pytest.approx(1 - 0.2 / 5 - (2.5 + 6) / 90)
    assert got["best_steps_per_checkpoint"] == round((math.sqrt(2 * 0.2 * 90) - 0.2) / 0.05)


# -- the draw ---------------------------------------------------------------------------------------
def test_the_draw_depends_on_seed_and_attempt_only():
    assert draw(7, 3, 60.0, 4) == draw(7, 3, 60.0, 4)
    assert draw(7, 3, 60.0, 4) != draw(7, 4, 60.0, 4)
    assert draw(7, 3, 60.0, 4) != draw(8, 3, 60.0, 4)


def test_the_draws_are_exponential_over_every_rank():
    draws = [draw(11, a, 60.0, 4) for a in range(4000)]
    mean = sum(d.delay_s for d in draws) / len(draws)
    assert mean == pytest.approx(60.0, rel=0.05)  # a fixed sample: its mean, not a chance
    median = sorted(d.delay_s for d in draws)[len(draws) // 2]
    assert median == pytest.approx(60.0 * math.log(2), rel=0.06)
    assert {d.rank for d in draws} == {0, 1, 2, 3}


@pytest.mark.parametrize("override,message", [
    ("train.chaos.mtbf_s=0", r"train.chaos.mtbf_s=0 must be a positive number of seconds"),
    ("train.chaos.mtbf_s=soon", r"train.chaos.mtbf_s='soon' must be a positive number"),
    ("train.chaos.seed=-1", r"train.chaos.seed=-1 must be an integer >= 0"),
])
def test_plan_refuses_bad_chaos_options(override, message):
    with pytest.raises(ConfigError, match=message):
        plan_for(1, "model=tiny", "train.steps=4", override)


def test_plan_carries_chaos():
    plan = plan_for(2, "model=tiny", "train.steps=4", "train.chaos.mtbf_s=30", "train.chaos.seed=5")
    assert (plan.chaos_mtbf_s, plan.chaos_seed) == (30, 5)


# -- the report -------------------------------------------------------------------------------------
def _event(attempt, event, **fields):
    return {"job": "j", "attempt": attempt, "event": event, **fields}


def _two_attempt_log():
    """Attempt 0: set-up 0-5, steps 0-3 (1 s each), a save after 2 (0.5 s), killed at 10.0; attempt 1
    starts at 12, set-up to 16, resumes at step 2: steps 2-3 again, then 4, and ends."""
    return [
        _event(0, "attempt", start=0.0), _event(0, "setup", start=0.0, end=5.0),
        _event(0, "step", step=0, start=5.0, end=6.0), _event(0, "step", step=1, start=6.0, end=7.0),
        _event(0, "save", step=2, start=7.0, end=7.5), _event(0, "step", step=2, start=7.5, end=8.5),
        _event(0, "step", step=3, start=8.5, end=9.5),
        _event(0, "fault", kind="chaos", rank=1, at=10.0, attempt_start=0.0, delay_s=10.0),
        _event(1, "attempt", start=12.0), _event(1, "setup", start=12.0, end=16.0),
        _event(1, "step", step=2, start=16.0, end=17.5), _event(1, "step", step=3, start=17.5, end=18.5),
        _event(1, "step", step=4, start=18.5, end=19.5), _event(1, "end", start=19.5, end=19.6),
    ]


def test_measure_splits_the_wall_time_into_its_parts():
    got = measure(_two_attempt_log())
    assert got["wall_s"] == pytest.approx(19.6)
    assert got["parts_sum_s"] == pytest.approx(got["wall_s"])
    parts = got["parts_s"]
    assert set(parts) == set(PARTS)
    assert parts["setup_s"] == pytest.approx(9.0)
    assert parts["useful_steps_s"] == pytest.approx(1 + 1 + 1.5 + 1 + 1)  # steps 0, 1 of attempt 0; 2-4 of 1
    assert parts["recomputed_steps_s"] == pytest.approx(2.0)  # steps 2, 3 of attempt 0
    assert parts["saves_s"] == pytest.approx(0.5)
    assert parts["in_flight_s"] == pytest.approx(0.5)  # 9.5 to the fault at 10
    assert parts["restart_s"] == pytest.approx(2.0)
    assert parts["finish_s"] == pytest.approx(0.1)
    assert (got["useful_steps"], got["recomputed_steps"], got["attempts"]) == (5, 2, 2)
    assert got["first_setup_s"] == pytest.approx(5.0)
    assert got["measured"] == pytest.approx(5.5 / 19.6)
    [failure] = got["failures"]
    assert failure["rank"] == 1 and failure["last_step_done"] == 3 and failure["to_setup_done_s"] == pytest.approx(6)


def test_goodput_block_predicts_from_the_jobs_own_measurements():
    block = goodput_block(_two_attempt_log(), steps_per_checkpoint=2, mtbf_s=60.0)
    inputs = block["predicted"]["inputs"]
    assert inputs["step_s"] == pytest.approx(1.0) and inputs["save_s"] == pytest.approx(0.5)
    assert inputs["restart_s"] == pytest.approx(6.0 + 0.5)  # to set-up done, plus the first step's excess
    assert goodput_block(_two_attempt_log(), 2, None)["predicted"] is None


def test_an_unfinished_log_is_refused():
    with pytest.raises(ValueError, match="has not finished"):
        measure(_two_attempt_log()[:-1])


def test_a_fault_only_the_recovery_journal_has_is_counted():
    """train.fail_mode=kill writes its fault to recovery.jsonl only: the report takes it from there,
    and ignores a record older than the job (another job's, in a reused run directory)."""
    events = [e for e in _two_attempt_log() if e["event"] != "fault"]
    journal = [{"event": "fault", "time": -50.0, "rank": 0, "attempt": 0, "step": 1, "mode": "kill"},
               {"event": "fault", "time": 10.0, "rank": 1, "attempt": 0, "step": 4, "mode": "kill"},
               {"event": "detected", "time": 10.1, "rank": 0, "attempt": 0}]
    added = journal_faults(events, journal)
    assert [(f["kind"], f["rank"], f["at"]) for f in added] == [("kill", 1, 10.0)]
    assert measure(events + added)["parts_s"] == measure(_two_attempt_log())["parts_s"]
    assert journal_faults(_two_attempt_log(), journal) == []  # the job log's own fault comes first
