"""lab/idle_cores.py: the kernel counters it splits the cores' time with.

Its figures are measurements, never asserted; what is asserted is that its reading
of /proc/stat covers the given CPUs' whole time, idle and busy together, as the cores x wall
split needs: over an interval the two counters together grow by about the CPUs times the interval;
and that its reading of a process's own ticks (torchrun's agent's share) follows that process's CPU,
and of its children's (the ranks') on their main threads and on their other threads apart.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import pytest
from launcher import PROJECT_ROOT


@pytest.fixture
def idle_cores(monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))
    return importlib.import_module("lab.idle_cores")


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
    assert idle_cores.cpu_ticks(set()) == {"idle": 0, "busy": 0, "irqs": 0}


def test_a_process_own_ticks_follow_its_cpu_time(idle_cores):
    tick = os.sysconf("SC_CLK_TCK")
    before, cpu0 = idle_cores.process_ticks(os.getpid()), time.process_time()
    deadline = time.process_time() + 0.5
    while time.process_time() < deadline:
        pass
    counted, spent = (idle_cores.process_ticks(os.getpid()) - before) / tick, time.process_time() - cpu0
    # The same CPU, counted in 10 ms ticks: a few ticks either way (the test's other threads, if any, too).
    assert counted == pytest.approx(spent, abs=5 / tick)


def test_a_process_that_is_gone_has_no_ticks(idle_cores):
    assert idle_cores.process_ticks(2**22 + 1) == 0


def test_a_child_busy_on_its_main_thread_counts_there(idle_cores):
    tick = os.sysconf("SC_CLK_TCK")
    # A child that spends 0.5 s of CPU on its main thread and 0.3 s on another, then waits to be read.
    code = ("import threading, time\n"
            "def spin(s):\n"
            "    end = time.thread_time() + s\n"
            "    while time.thread_time() < end: pass\n"
            "t = threading.Thread(target=spin, args=(0.3,)); t.start(); spin(0.5); t.join()\n"
            "print('done', flush=True); time.sleep(30)\n")
    # Against what this process's other children (earlier tests' leftovers, if any) had already counted.
    main_before, others_before = idle_cores.children_ticks(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        main, others = idle_cores.children_ticks(os.getpid())
        main, others = main - main_before, others - others_before
    finally:
        child.kill()
        child.wait()
    # The interpreter's own start-up is on the main thread too: a few ticks more there.
    assert main / tick == pytest.approx(0.5, abs=8 / tick)
    assert others / tick == pytest.approx(0.3, abs=3 / tick)
