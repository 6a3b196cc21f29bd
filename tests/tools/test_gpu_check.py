"""launch/gpu_check.sh, dry-run on the CPU: the one script a GPU machine runs, every step of it on gloo.

On a GPU machine the script runs these steps on NCCL and CUDA at model=gpt2; here `--dry-run` runs
the same steps (one-rank self-check, single in fp32 and bf16 with recomputation, a one-rank compare,
dp, tp, every pipeline schedule, zero3 and 3d against single, a rank that hangs, the planner's what-if
on the h200's links) on
gloo ranks at model=tiny. What this proves: the script's steps are well formed and pass where they
can run, so that a GPU machine's first run fails only on what is different there. Its runs and its
compare are given virtual time's loopback figures (GPU_CHECK_LOOPBACK), as every run of the suite is and
as an NCCL run needs none: launch.compare's own probe of them is tools/test_replay.py's.
"""

import json
import subprocess
import sys
from pathlib import Path

from launcher import GIVEN_LOOPBACK

from launch.gpu_check_figures import loss_verdict

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_zbh1", "pp_zbv", "pp_dualpipev")


def test_the_gpu_check_dry_run_passes_every_step_on_gloo(tmp_path):
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                            "GPU_CHECK_DIR": str(tmp_path), "HOME": str(tmp_path),
                                            "GPU_CHECK_LOOPBACK": " ".join(GIVEN_LOOPBACK)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    verdicts = {line.split()[1]: line.split()[0] for line in (tmp_path / "verdicts.txt").read_text().splitlines()}
    runs = ["single_fp32", "single_bf16_recompute", "dp", "tp", *SCHEDULES, "zero3", "3d"]
    expected = ["pytest_gpu", "selfcheck_gloo", "compare_1rank", "whatif_nvlink", "fault_hang", *runs,
                *(f"losses_{name}" for name in ["dp", "tp", *SCHEDULES, "zero3", "3d"])]
    assert {name: verdicts.get(name) for name in expected} == dict.fromkeys(expected, "PASS"), verdicts
    assert "FAIL" not in verdicts.values()
    # The pipelines posted their sends and receives as they will on NCCL (parallel.pp_posting=nccl).
    for name in [*SCHEDULES, "3d"]:
        assert json.loads((tmp_path / name / "summary.json").read_text())["pipeline"]["posting"] == "nccl", name
    selfcheck = (tmp_path / "selfcheck_gloo.log").read_text()
    # Every strategy but the one that cannot run in one process was built as itself and matched single.
    for preset in ("dp", "zero1", "zero3", "tp_sp", "pp_zbv", "cp_a2a", "ep", "torch_fsdp2", "torch_pp_dualpipev"):
        assert f"ok   strategy {preset}:" in selfcheck, selfcheck
    assert "skip strategy accelerate_ddp:" in selfcheck
    assert proc.stdout.splitlines()[-1].startswith("gpu_check --dry-run: ")


def test_a_loss_off_by_more_than_the_tolerance_fails_the_check():
    assert loss_verdict("dp", [2.0, 1.5], [2.0, 1.5]).startswith("PASS losses_dp within 0.0e+00")
    assert loss_verdict("dp", [2.0, 1.5001], [2.0, 1.5]).startswith("FAIL losses_dp within 6.7e-05")
    assert loss_verdict("dp", [2.0], [2.0, 1.5]).startswith("FAIL losses_dp 1 losses")
