"""The job the restart tests on several nodes share, and what they check against.

tests/tools/test_net_restarts.py (two emulated nodes, launch.run) and tests/tools/test_slurm.py
(the local Slurm cluster) run this job at world 4 = 2 nodes x 2 ranks with failures; the session
fixture `restart_reference` (tests/tools/conftest.py) runs it once without any, under plain
torchrun. parallel=tp: each tp pair is one node's two ranks, the dp all-reduce crosses nodes.
"""

from launcher import TINY

STEPS = 10
RESTART_JOB = [*(o for o in TINY if not o.startswith("train.steps=")), f"train.steps={STEPS}", "parallel=tp",
               "train.checkpoint_every=2", "train.resume=auto"]
# Rank 1 (node 0) SIGKILLs itself before step 5, in the job's first attempt only.
KILL_RANK_1_AT_5 = ["train.fail_mode=kill", "train.fail_at_step=5", "train.fail_rank=1"]


def check_repeats_reference(summary: dict, reference: dict) -> None:
    """The whole job's losses (steps 0-9, those before each restart included) and final
    parameters, bitwise those of the uninterrupted run."""
    assert summary["first_step"] == 0 and len(summary["losses"]) == STEPS, summary["losses"]
    assert summary["losses"] == reference["losses"], f"{summary['losses']}\n{reference['losses']}"
    assert summary["final_params_sha256"] == reference["final_params_sha256"]
