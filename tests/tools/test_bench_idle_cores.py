"""bench/idle_cores.py: the kernel counters it splits the cores' time with.

The bench's figures are measurements (docs/virtual-time.md); what is asserted is that its reading
of /proc/stat covers the given CPUs' whole time, idle and busy together, as the cores x wall
split needs: over an interval the two counters together grow by about the CPUs times the interval.
"""

from __future__ import annotations

import importlib
import os
import time

import pytest
from launcher import PROJECT_ROOT


@pytest.fixture
def idle_cores(monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    return importlib.import_module("idle_cores")


def test_idle_and_busy_together_cover_every_cpu_the_whole_interval(idle_cores):
    cpus = os.sched_getaffinity(0)
    tick = os.sysconf("SC_CLK_TCK")
    before, t0 = idle_cores.cpu_ticks(cpus), time.monotonic()
    time.sleep(1.0)
    after, elapsed = idle_cores.cpu_ticks(cpus), time.monotonic() - t0
    counted = (after["idle"] - before["idle"] + after["busy"] - before["busy"]) / tick
    # The counters tick at SC_CLK_TCK (100 Hz): a tick or two per CPU either way.
    assert counted == pytest.approx(len(cpus) * elapsed, abs=len(cpus) * 3 / tick)


def test_a_cpu_outside_the_set_is_not_counted(idle_cores):
    assert idle_cores.cpu_ticks(set()) == {"idle": 0, "busy": 0}
