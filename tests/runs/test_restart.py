"""A killed rank costs a restart and loses nothing: torchrun --max-restarts with train.resume=auto.

Every case is a 10-step world-4 job on a tiny model with a checkpoint every 2 steps, whose rank 1
SIGKILLs itself before step 5 (train.fail_mode=kill): torchrun stops the other ranks and starts
all four again, the new attempt resumes from step 4's checkpoint, and the job exits 0. Against
one uninterrupted run of the same training config (which saves no checkpoint; all seven forked
from one pool of ranks) it must show:
  - the losses of steps 0-9 (summary.json covers the whole job, the steps before the restart
    included) and final_params_sha256 bitwise equal: recovery lost nothing and repeated the
    recomputed step exactly;
  - one `recovery` entry per failure whose parts (detection, teardown, restart, rendezvous,
    set-up, load, recomputed steps) sum to the downtime, measured by its two ends alone, within 10%.
One job (3d, on tiny_llama) fails twice: the kill, then, in the attempt that replaced it, rank 0
SIGKILLed while step 8's checkpoint is written but not yet published (--max-restarts=2): the
third attempt must ignore that partial checkpoint and resume from step 6's.
"""

import json
import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, GIVEN_LOOPBACK, PROJECT_ROOT, assert_ok

JOB = ["train.steps=10", "train.warmup_steps=1", "train.global_batch=16", "data.max_bytes=1000000",
       "train.peak_flops=1e11", "run.timeline=false", *GIVEN_LOOPBACK]
SAVE = ["train.checkpoint_every=2", "train.resume=auto"]
KILL = ["train.fail_mode=kill", "train.fail_at_step=5", "train.fail_rank=1"]
# The kill, then in the next attempt the checkpoint writer killed mid-save.
KILL_THEN_SAVE = ["train.fail_mode=[kill,kill_during_save]", "train.fail_at_step=[5,8]", "train.fail_rank=[1,0]"]


def _restarting_job(overrides: list[str], run_dir, max_restarts: int):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           f"--max-restarts={max_restarts}", "-m", "launch.train", *overrides, f"run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CPU_ONLY})


def _check_recovery(entry: dict, step: int, rank: int, resumed_from: int) -> None:
    assert (entry["fault_step"], entry["fault_rank"], entry["resumed_from_step"]) == (step, rank, resumed_from), entry
    assert entry["steps_recomputed"] == step - resumed_from
    if entry["survivors_detected"] == 0:  # torchrun stopped every survivor before it could stamp (best effort)
        assert entry["detection_s"] == entry["teardown_s"] == 0, entry
    assert all(entry[k] >= 0 for k in ("detection_s", "teardown_s", "restart_s", "rendezvous_s", "load_s")), entry
    assert abs(entry["unexplained_s"]) <= 0.1 * entry["downtime_s"], entry


CASES = [
    ("dp", "tiny", KILL, 1),
    ("zero3", "tiny", KILL, 1),
    ("tp", "tiny", KILL, 1),
    ("pp_1f1b", "tiny", KILL, 1),
    ("3d", "tiny_llama", KILL_THEN_SAVE, 2),
    ("torch_ddp", "tiny", KILL, 1),
    ("torch_fsdp2", "tiny", KILL, 1),
]


def _config(preset: str, model: str) -> list[str]:
    return [f"model={model}", f"parallel={preset}", *JOB]


@pytest.fixture(scope="module")
def references(pools, tmp_path_factory) -> dict[str, dict]:
    """Every case's uninterrupted run, forked one after another from the session's pool of 4 ranks
    (tests/conftest.py `pools`, over parallel/compare/pool.py: a pooled run is the fresh torchrun's,
    to the bit; tests/tools/test_compare_pool.py), so the imports are paid once, not once per case.
    The reference saves no checkpoint: saving must not change a bit of the training either."""
    root = tmp_path_factory.mktemp("restart_references")
    return {preset: assert_ok(pools.run(4, _config(preset, model), root / preset)) for preset, model, *_ in CASES}


@pytest.mark.parametrize("preset,model,faults,failures", CASES)
def test_a_killed_rank_is_restarted_and_the_job_repeats_the_uninterrupted_run(preset, model, faults, failures,
                                                                               references, tmp_path):
    config = _config(preset, model)
    reference = references[preset]
    job = _restarting_job([*config, *SAVE, *faults], tmp_path / "job", max_restarts=failures)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    assert "injecting train.fail_mode=kill at step 5" in job.stderr
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["attempt"] == failures and summary["first_step"] == 0
    assert summary["losses"] == reference["losses"] and len(summary["losses"]) == 10
    assert summary["final_params_sha256"] == reference["final_params_sha256"]
    assert reference["recovery"] == [] and len(summary["recovery"]) == failures, summary["recovery"]
    _check_recovery(summary["recovery"][0], step=5, rank=1, resumed_from=4)
    assert "recovery: rank 1 failed (kill) before step 5, resumed from step 4" in job.stdout
    if failures == 2:
        _check_recovery(summary["recovery"][1], step=8, rank=0, resumed_from=6)
        names = sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir())
        assert any(n.startswith("step_000008.tmp-") for n in names) and "step_000008" in names, names
