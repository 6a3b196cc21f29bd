"""Fixtures of the tool tests that more than one file uses."""

import pytest
from launcher import assert_ok
from restart_job import RESTART_JOB


@pytest.fixture(scope="session")
def restart_reference(pools, tmp_path_factory):
    """restart_job.RESTART_JOB once, uninterrupted, at world 4 (forked from the session's pool of
    torchrun ranks, the fresh run to the bit): what the restarted jobs on emulated nodes and under
    Slurm must repeat bitwise."""
    run = pools.run(4, RESTART_JOB, tmp_path_factory.mktemp("restart_reference") / "run")
    assert_ok(run)
    return run
