"""Bad input under torchrun: a clear one-line message and a non-zero exit within seconds, never a hang."""

import time

import pytest
from launcher import TINY, run_train


@pytest.mark.parametrize("world,overrides,message", [
    (2, ["parallel.dp=3"], "error: world size 2 != parallel.dp x parallel.tp x parallel.pp = 3 x 1 x 1 = 3"),
    (2, ["data.path=/no/such/corpus"], "error: data.path='/no/such/corpus' does not exist"),
    (2, ["parallel=pp_interleaved", "parallel.microbatches=3", "train.global_batch=12"],
     "error: parallel.microbatches=3 is not a multiple of parallel.pp=2"),
    (3, ["parallel=tp", "parallel.tp=3"],
     "error: model.n_heads=4 is not divisible by parallel.tp=3: use a tp that divides the head count (1, 2 or 4)"),
    (1, ["parallel=3d"], "error: world size 1 is not divisible by parallel.tp x parallel.pp = 2 x 2 = 4"),
])
def test_bad_layout_exits_nonzero_with_its_message(world, overrides, message, tmp_path):
    start = time.monotonic()
    run = run_train(world, [*TINY, *overrides], tmp_path / "run", timeout=90)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-2000:]
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    # Refused before training: no process group, no summary.
    assert not (tmp_path / "run" / "summary.json").exists()


def test_bad_data_in_one_process_exits_nonzero_with_one_line(tmp_path):
    """World 1 too: an empty corpus file is refused in one line naming the path, status 2."""
    (tmp_path / "empty.txt").write_text("")
    run = run_train(1, [*TINY, f"data.path={tmp_path / 'empty.txt'}"], tmp_path / "run", timeout=90)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: data.path='{tmp_path / 'empty.txt'}' is empty: give a file or directory with some text in it"]


def test_unknown_preset_is_refused_by_name(tmp_path):
    run = run_train(1, ["parallel=zero9"], tmp_path / "run", timeout=90)
    assert run.returncode == 2
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("error: parallel=zero9 is not a preset of conf/parallel/: choose one of 3d, ")


@pytest.mark.parametrize("overrides,message", [
    (["parallel.dp=3"], "error: world size 2 != parallel.dp x parallel.tp x parallel.pp = 3 x 1 x 1 = 3"),
    (["model=nonexistent"], "error: model=nonexistent is not a preset of conf/model/"),
])
def test_the_launcher_validates_first_and_ends_with_the_line(overrides, message):
    """`python -m launch.run` checks the whole plan for its world before starting torchrun: a bad
    configuration ends with the project's one line, last, and exit status 2 (torchrun's own
    report of failed workers never comes)."""
    import subprocess
    import sys

    from launcher import PROJECT_ROOT

    proc = subprocess.run([sys.executable, "-m", "launch.run", "net.procs_per_node=2", *overrides], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-2000:]
