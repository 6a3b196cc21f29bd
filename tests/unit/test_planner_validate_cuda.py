"""The planner's validation reads a run's saved activations only where the run checked them: on CUDA
the summary says the formula does not describe the attention kernel (activations_check_note), and
such a run must not count as a measurement of the formula, for or against it."""

from parallel.planner.validate import measured_columns

ROW = {"bytes_per_step": None, "layout": {"pp": 1}, "step_time_s": None,
       "memory_by_stage": [{"activations": 1000, "params": None}]}


def _summary(note):
    return {"memory": {"activations_bytes_measured": [1400, 1400], "activations_check_note": note,
                       "by_rank": [{"total_bytes": 10}, {"total_bytes": 10}]},
            "world_size": 2, "step_time_s": 1.0, "tokens_per_s": 1.0, "mfu": {"mfu": None},
            "comm": {"exposed_seconds_per_step": 0.0, "sent_bytes_per_step": 0, "sent_bytes_per_step_exact": "0"}}


def test_activations_of_a_run_that_checked_them_are_compared():
    measured, errors = measured_columns(ROW, _summary(None))
    assert measured["activation_bytes_by_rank"] == [1400, 1400]
    assert abs(errors["activations"] - 400 / 1400) < 1e-12  # the largest relative error of a rank


def test_activations_of_a_run_on_cuda_are_not_taken_as_a_measurement_of_the_formula():
    measured, errors = measured_columns(ROW, _summary("not checked on CUDA: another kernel's saved tensors"))
    assert measured["activation_bytes_by_rank"] is None and errors["activations"] is None
