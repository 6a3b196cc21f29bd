"""lab/host_speed.py, the floor under every CPU-timed figure, runs as its docstring shows it.

Nothing here looks at a timing: a few windows of a few steps check that every documented option
parses, that each window prints both clocks (or, with `reference=1`, the model beside its two
reference kernels and their ratios; with `beside=1`, a second process's window beside it), and
that a bad option is refused by name before any work.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from launcher import CPU_ONLY, PROJECT_ROOT


def host_speed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab.host_speed", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **CPU_ONLY})


def test_windows_report_both_clocks_and_the_stability_statistic():
    out = host_speed("windows=4", "steps=2", "gap_s=0").stdout
    windows = re.findall(r"window +\d+: CPU +([\d.]+) ms +wall +([\d.]+) ms", out)
    assert len(windows) == 4
    # Wall time includes the thread's CPU time: a window's wall figure is never below its CPU one by
    # more than the printing's rounding.
    assert all(float(w) >= float(c) - 0.01 for c, w in windows)
    assert "4 windows of 2 steps, 0 s apart" in out
    # 4 windows hold 2 runs of 3 consecutive ones.
    assert re.search(r"every 3 consecutive windows on the CPU clock .*: \d of 2 within ±5%", out)


def test_reference_kernels_are_timed_beside_the_model():
    out = host_speed("windows=3", "steps=2", "gap_s=0", "reference=1").stdout
    assert len(re.findall(r"window +\d+: model .* matmul .* Python loop .* model/matmul .* model/Python", out)) == 3
    for name in ("model", "matmul", "Python loop"):
        assert re.search(rf"^  {name} +median [\d.]+, range", out, re.M), name
    assert re.search(r"model / matmul: median [\d.]+, range", out)
    assert re.search(r"model / Python loop: median [\d.]+, range", out)


def test_bad_options_are_refused_by_name():
    bad = host_speed("window=3")
    assert bad.returncode != 0 and "unknown option 'window'" in bad.stderr and "windows" in bad.stderr
    bad = host_speed("reference=2")
    assert bad.returncode != 0 and "reference='2': give 0 or 1" in bad.stderr
    bad = host_speed("beside=yes")
    assert bad.returncode != 0 and "beside='yes': give 0 or 1" in bad.stderr
    bad = host_speed("reference=1", "beside=1")
    assert bad.returncode != 0 and "give one" in bad.stderr


def test_a_second_process_beside_times_the_same_windows():
    beside = host_speed("windows=3", "steps=2", "gap_s=0", "beside=1")
    if len(os.sched_getaffinity(0)) < 2:
        assert beside.returncode != 0 and "beside=1 needs two usable cores" in beside.stderr
        return
    assert beside.returncode == 0, beside.stderr
    out = beside.stdout
    lines = re.findall(r"window +\d+: CPU +([\d.]+) ms +beside +([\d.]+) ms +ratio +([\d.]+)", out)
    assert len(lines) == 3
    # The printed ratio is the two printed figures' (to the printing's rounding).
    assert all(abs(float(c) / float(b) - float(r)) < 0.02 for c, b, r in lines)
    assert re.search(r"^  beside median [\d.]+, range", out, re.M)
    assert re.search(r"this core / the other: median [\d.]+, range [\d.]+-[\d.]+, max dev\. from median ±", out)
