"""`train.gloo_loop_policy` (parallel/dist/gloo_loop.py): gloo's event-loop threads are set to
SCHED_BATCH, so that one woken on the core of the thread it waits for does not take that core.

What the policy buys is a timing (lab/gloo_call_costs.py measures it; docs/virtual-time.md gives
the figures); these tests check what can be checked exactly: which threads get which policy, in a
live training run and in one process, and that a bad choice is refused by name.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT, look_at_live_ranks

from parallel.dist.gloo_loop import LOOP_THREAD_NAME, apply_gloo_loop_policy, gloo_loop_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                                reason="scheduling policies per thread are Linux's")


def _loop_thread_policies(pid: int) -> list[int]:
    """The scheduling policy of each gloo event-loop thread of process `pid`."""
    return [os.sched_getscheduler(tid) for tid in gloo_loop_threads(pid)]


def test_a_live_run_sets_every_gloo_loop_thread_of_every_rank(tmp_path):
    """Both ranks of a dp run, looked at from outside while they train (after the warm-up step that
    applies the policy again): every gloo event-loop thread, one per process group, is SCHED_BATCH."""
    policies, logged = look_at_live_ranks(tmp_path / "run", [], lambda pids: {
        r: _loop_thread_policies(pid) for r, pid in pids.items()})
    for r, found in policies.items():
        assert found, f"rank {r} has no {LOOP_THREAD_NAME} thread"
        assert set(found) == {os.SCHED_BATCH}, f"rank {r}: policies {found}, SCHED_BATCH is {os.SCHED_BATCH}"
    assert re.search(r"gloo event loop: batch \(\d+ gloo event-loop thread\(s\) set to SCHED_BATCH", logged), logged


SET_AND_RESET = """
import json, os, torch.distributed as dist
from parallel.dist.gloo_loop import apply_gloo_loop_policy, gloo_loop_threads
def policies():
    return [os.sched_getscheduler(t) for t in gloo_loop_threads()]
out = {"before": policies(), "said_before": apply_gloo_loop_policy("batch")}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out["after_init"] = policies()
out["said"] = apply_gloo_loop_policy("batch")
out["batch"] = policies()
dist.new_group([0])                # a group made later has its own thread, at the default policy
out["new_group"] = policies()
apply_gloo_loop_policy("batch")    # applied again: every thread, the new one too
out["batch_again"] = policies()
apply_gloo_loop_policy("normal")
out["normal"] = policies()
dist.destroy_process_group()
print(json.dumps(out))
from parallel.dist.groups import exit_process
exit_process(0)  # past gloo's finalisation abort (parallel/dist/groups.py)
"""


def test_set_and_reset_in_one_process():
    proc = subprocess.run([sys.executable, "-c", SET_AND_RESET], capture_output=True, text=True, timeout=120,
                          cwd=PROJECT_ROOT, env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    batch, other = os.SCHED_BATCH, os.SCHED_OTHER
    assert out["before"] == []  # no group, no gloo thread: nothing to set
    assert out["said_before"] == "batch (no gloo event-loop thread in this process)"
    assert out["after_init"] == [other]
    assert out["said"] == "batch (1 gloo event-loop thread(s) set to SCHED_BATCH: they no longer preempt on wake-up)"
    assert out["batch"] == [batch]
    assert sorted(out["new_group"]) == sorted([batch, other])
    assert out["batch_again"] == [batch, batch]
    assert out["normal"] == [other, other]


def test_a_bad_choice_is_named():
    with pytest.raises(ValueError, match=r"train.gloo_loop_policy='idle': choose one of batch, normal"):
        apply_gloo_loop_policy("idle")
