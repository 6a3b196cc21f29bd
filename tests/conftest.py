"""Shared by every folder under tests/: the session's single-process reference run.

The folders say what a test needs: unit/ nothing (one process, no process group), layers/ gloo
ranks spawned inside the pytest process (helpers/spawn.py), runs/ `launch.train` under torchrun,
tools/ the command-line tools (compare, planner, emulated networks, documented commands, clusters,
GPUs). helpers/ holds the launchers and the scripts torchrun starts by path; pyproject.toml puts it
on sys.path.
"""

import pytest
from launcher import TINY, TINY_LLAMA, RunPools, assert_ok


@pytest.fixture(scope="session")
def pools():
    """The session's pools of waiting ranks, one per world size: `pools.run(nproc, overrides, run_dir)`
    forks a run that must succeed from them (tests/helpers/launcher.py: RunPools)."""
    runs = RunPools()
    yield runs
    runs.close()


@pytest.fixture(scope="session")
def single_run(pools, tmp_path_factory):
    """The single-process reference every strategy is compared with (tiny model, 6 steps; final
    parameters and step 0's gradients saved)."""
    run = pools.run(1, [*TINY, "parallel=single", "train.save_final=true", "train.save_grads=true"],
                    tmp_path_factory.mktemp("single") / "run")
    assert_ok(run)
    return run


@pytest.fixture(scope="session")
def single_run_llama(pools, tmp_path_factory):
    """The same reference on Llama's block (model=tiny_llama: GQA, SwiGLU, RMSNorm, RoPE, no bias)."""
    run = pools.run(1, [*TINY_LLAMA, "parallel=single", "train.save_final=true", "train.save_grads=true"],
                    tmp_path_factory.mktemp("single_llama") / "run")
    assert_ok(run)
    return run


# The quick tier (`pytest -m "not slow"`): what runs in one process or spawns gloo ranks inside pytest.
# Everything that starts torchrun, a tool's command line, a cluster or a lab script takes seconds to minutes a test.
SLOW_FOLDERS = ("runs", "tools", "lab")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
