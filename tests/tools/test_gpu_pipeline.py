"""The pipeline schedules that hung on the executor's first GPU posting, run on NCCL (2 GPUs).

Interleaved 1F1B, ZB-V and DualPipeV formed a cycle under NCCL's rules as the executor first
posted them (parallel/pp/progress.py; tests/unit/test_pp_posting.py shows it); the executor now
posts each send and receive on its link (parallel/pp/posting.py). On two GPUs each runs with the
backend's own posting, at the tiny model's size and with 12 MiB activations (d_model 768, 1024
positions, 4 sequences per microbatch: where a message too large for NCCL's buffers needs its
receive running before the send completes). Checked: the run ends with the nccl posting, its
bytes equal the closed forms, the tiny runs' losses match the CPU's single run to within the GPU's
summation order, and the spans, CUDA events on the GPU, give positive F and B times and a bubble
between 0 and 1. Skipped with the reason on fewer than two GPUs; `launch/gpu_check.sh` runs them.
"""

import pytest
from launcher import TINY, assert_ok, max_rel_diff, run_train
from test_gpu import needs_two_gpus

LARGE = ["model.d_model=768", "model.seq_len=1024", "model.n_heads=12"]  # b·s·h·4 = 4·1024·768·4 bytes


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("size", ["tiny", "12MiB"])
@pytest.mark.parametrize("preset", ["pp_interleaved", "pp_zbv", "pp_dualpipev"])
def test_pipelines_run_on_nccl_with_the_link_posting(preset, size, single_run, tmp_path):
    overrides = [*TINY, f"parallel={preset}", "parallel.microbatches=4", *(LARGE if size == "12MiB" else [])]
    s = assert_ok(run_train(2, overrides, tmp_path / "run", gpu=True))
    assert (s["parallel"]["backend"], s["device"]) == ("nccl", "cuda")
    assert s["pipeline"]["posting"] == "nccl" and s["comm_matches_theory"]
    if size == "tiny":
        assert max_rel_diff(s["losses"], single_run.summary["losses"]) < 1e-3
    pipe = s["pipeline"]
    assert pipe["mean_forward_s"] > 0 and pipe["mean_backward_s"] > 0 and 0.0 <= pipe["bubble_measured"] < 1.0
