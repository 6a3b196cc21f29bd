"""Fixtures of the tool tests that more than one file uses."""

import pytest
from launcher import assert_ok, run_train
from restart_job import RESTART_JOB


@pytest.fixture(scope="session")
def restart_reference(tmp_path_factory):
    """restart_job.RESTART_JOB once, uninterrupted, under `torchrun --standalone` at world 4: what
    the restarted jobs on emulated nodes and under Slurm must repeat bitwise."""
    run = run_train(4, RESTART_JOB, tmp_path_factory.mktemp("restart_reference") / "run")
    assert_ok(run)
    return run
