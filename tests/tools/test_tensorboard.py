"""train.tensorboard=true: rank 0's event files hold every step's metrics.jsonl values, the time
breakdown and the bytes per group; the sweep gives each strategy its own TensorBoard run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, GIVEN_LOOPBACK, PROJECT_ROOT, TINY, Run, assert_ok, run_train

from parallel.report import tensorboard

pytest.importorskip("tensorboard", reason="the optional tensorboard package: pip install -e '.[tensorboard]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

CATEGORIES = ["compute", "exposed_comm", "bubble", "optimizer", "other"]


def scalars(log_dir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_event_files_hold_the_metrics_of_every_step(pools, tmp_path):
    run = pools.run(2, [*TINY, "parallel=tp", "train.tensorboard=true"], tmp_path / "run")
    assert_ok(run)
    metrics = run.metrics()
    board = scalars(tmp_path / "run" / "tensorboard")
    assert {"loss", "tokens_per_s", "step_time_s", "bytes_sent/total", "bytes_sent/tp",
            *(f"time/{c}" for c in CATEGORIES)} <= board.keys()
    steps = [m["step"] for m in metrics]
    assert steps == list(range(6))
    # Events store float32: equal to metrics.jsonl's float64 values to float32 rounding.
    for tag, key in [("loss", "loss"), ("tokens_per_s", "tokens_per_s"), ("step_time_s", "step_time_s"),
                     ("bytes_sent/total", "rank0_sent_bytes")]:
        assert sorted(board[tag]) == steps, tag
        for m in metrics:
            assert board[tag][m["step"]] == pytest.approx(m[key], rel=1e-6), (tag, m["step"])
    assert any(m["rank0_sent_bytes"] > 0 for m in metrics)  # tp all-reduces: something to compare
    groups = [t for t in board if t.startswith("bytes_sent/") and t != "bytes_sent/total"]
    for m in metrics:
        step = m["step"]
        assert sum(board[g][step] for g in groups) == pytest.approx(m["rank0_sent_bytes"], rel=1e-6)
        # The five parts of rank 0's step add up to its time.
        assert sum(board[f"time/{c}"][step] for c in CATEGORIES) == pytest.approx(m["step_time_s"], rel=1e-5)


def test_off_by_default(pools, tmp_path):
    run = pools.run(1, [*TINY, "train.steps=2"], tmp_path / "run")
    assert_ok(run)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_the_sweep_writes_one_run_per_strategy(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "launch.compare", "compare.world=2", "compare.strategies=[single,dp]",
                           "model=tiny", "train.steps=2", "train.warmup_steps=1", "data.max_bytes=1000000",
                           "compare.peak_flops=1e11", "train.tensorboard=true", *GIVEN_LOOPBACK, f"run.dir={sweep}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=200,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in (sweep / "tensorboard").iterdir()) == ["dp", "single"]
    for strategy in ("single", "dp"):
        metrics = Run(0, "", "", sweep / strategy).metrics()
        board = scalars(sweep / "tensorboard" / strategy)
        assert board["loss"] == {m["step"]: pytest.approx(m["loss"], rel=1e-6) for m in metrics}
        assert not (sweep / strategy / "tensorboard").exists()


def test_requested_but_not_installed_is_one_line(monkeypatch):
    real = tensorboard.importlib.util.find_spec
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    error = tensorboard.option_error(True, None)
    assert error.startswith("train.tensorboard=true needs the tensorboard package, which is not installed")
    assert "\n" not in error
    assert tensorboard.option_error(False, None) is None  # not requested: not needed


def test_a_bad_value_is_refused_in_one_line(tmp_path):
    run = run_train(1, [*TINY, "train.tensorboard=maybe"], tmp_path / "run", timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == "error: train.tensorboard='maybe' must be true or false"
