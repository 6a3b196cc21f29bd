import pytest
from launcher import TINY, assert_ok, run_train


@pytest.fixture(scope="session")
def single_run(tmp_path_factory):
    """The single-process reference every strategy is compared with (tiny model, 6 steps; final
    parameters and step 0's gradients saved)."""
    run = run_train(1, [*TINY, "parallel=single", "train.save_final=true", "train.save_grads=true"],
                    tmp_path_factory.mktemp("single") / "run")
    assert_ok(run)
    return run
