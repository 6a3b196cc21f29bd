"""bench/virtual_time.py, the validation table's bench: its options and its runs made at once.

The bench's checks themselves are timings, measured and written into docs/virtual-time.md, never
asserted here. What is asserted: a bad option is refused by name before any run, and repeats
started together (`repeats_at=once`, the stability check's default) are real, separate runs of the
same config: each its own directory and summary, the same losses to the bit, as the same config
made twice one after another gives.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT

SCRIPT = str(PROJECT_ROOT / "bench" / "virtual_time.py")


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **CPU_ONLY})


@pytest.mark.parametrize("args, said", [
    (["repeats_at=sometimes"], "repeats_at='sometimes': once (the repeats started together) or apart"),
    (["loopback=per-run"], "repeats_at=once needs loopback=sampled or once"),
    (["checks=stability,speed"], "unknown check(s) speed"),
    (["reps=3"], "unknown option 'reps'"),
])
def test_bad_options_are_refused_by_name(args, said, tmp_path):
    result = bench(*args, f"out={tmp_path}")
    assert result.returncode != 0
    assert said in result.stderr
    assert not any(tmp_path.iterdir())  # refused before any run


def test_repeats_started_together_are_separate_runs_of_one_config(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    for key, value in CPU_ONLY.items():
        monkeypatch.setenv(key, value)
    import virtual_time

    # The loopback's figures given, as the bench gives its probe to every run: no run probes it.
    given = ["virtual.loopback_gbytes_per_s=1.0", "virtual.loopback_latency_us=200",
             "virtual.loopback_p2p_latency_us=100"]
    batch = virtual_time.Batch(tmp_path, ["model=tiny", "train.steps=2", *given], sampled=False)
    dirs = [tmp_path / f"once-{k}" for k in range(2)]
    summaries = batch.train_together(2, [*batch.common, "parallel=dp"], dirs)
    assert summaries[0]["losses"] == summaries[1]["losses"] and len(summaries[0]["losses"]) == 2
    assert all((d / "summary.json").exists() for d in dirs)
    assert all(s["virtual"]["link_model"]["intra"]["latency_s"] == pytest.approx(200e-6) for s in summaries)
    # Both commands are printed as started in the background, then waited for.
    assert [c.endswith(" &") for c in batch.commands] == [True, True, False]
    assert batch.commands[-1] == "wait"
    # One host window before them stands for both.
    assert batch.host_cpu[dirs[0].name] == batch.host_cpu[dirs[1].name] > 0
