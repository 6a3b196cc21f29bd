"""A run that finished its work exits 0 on every rank, every time.

gloo runs on torch 2.13 have been seen to abort at exit ("terminate called without an active
exception", exit -6) after all their work was done, in about half of 4-rank DDP runs (the
README's "Clean exits on gloo"). parallel/dist/groups.py's shutdown waits and drops every async handle, barriers,
and only then destroys the process groups, and the worker leaves without interpreter
finalisation. This test repeats 4-rank runs of the bucketed dp, of DDP and of a 4-stage 1F1B
pipeline, and requires a clean exit from every one.
"""

import pytest
from launcher import GIVEN_LOOPBACK, run_train

# Every other multi-process test also requires exit 0 of every run; these repeat the three kinds
# of outstanding async work at 4 ranks on purpose.
REPEATS = 2
# The peak and the loopback given, no timeline drawn: what these runs test is how they end.


# dp: async all-reduces from backward hooks; torch_ddp: DDP's reducer; pp_1f1b: async sends.
@pytest.mark.parametrize("preset", ["dp", "torch_ddp", "pp_1f1b"])
def test_repeated_four_rank_runs_all_exit_cleanly(preset, tmp_path):
    failures = []
    for i in range(REPEATS):
        run = run_train(4, ["model=tiny", "train.steps=2", "train.warmup_steps=1", "data.max_bytes=100000",
                            f"parallel={preset}", "parallel.bucket_mb=0.1", "train.peak_flops=1e11",
                            "run.timeline=false", *GIVEN_LOOPBACK],
                        tmp_path / f"run{i}", timeout=120)
        if run.returncode != 0 or "terminate called" in run.stderr or not (run.run_dir / "summary.json").exists():
            failures.append((i, run.returncode, run.stderr[-1500:]))
    assert not failures, f"{len(failures)}/{REPEATS} runs did not exit cleanly: {failures}"
