"""PyTorch's own parallelism as strategies (parallel/baselines/): the same model, data, init and
optimizer as ours, so the same losses and final parameters as the single-process run, and their
traffic, counted around DTensor's and pipelining's communication calls or through DDP's comm hook,
equal to its closed form's figure."""

import pytest
from launcher import assert_ok, check_matches_single, tiny_settings
from omegaconf import OmegaConf

from parallel.dist.dims import ParallelDims
from parallel.registry import expected_comm
from parallel.run_plan import model_config

# preset -> extra overrides. World 2 keeps them cheap: torch_tp is dp 1 x tp 2, torch_pp 2 stages
# x 4 microbatches (interleaved: 2 chunks per rank, one block each).
BASELINES = {
    "accelerate_ddp": [],
    "torch_tp": [],
    "torch_pp_gpipe": [],
    "torch_pp_1f1b": [],
    "torch_pp_interleaved": [],
    # The zero-bubble ones (torch builds no V itself: the baseline hands it stages r and 2p-1-r).
    "torch_pp_zbv": ["parallel.microbatches=4"],
    "torch_pp_dualpipev": ["parallel.microbatches=4"],
    "torch_pp_interleaved_zb": [],
    # Llama's block: FSDP2's groups of other shapes (K, V of the kv heads' width, SwiGLU's gate, no biases).
    "torch_fsdp2-llama": ["model=tiny_llama"],
}


@pytest.mark.parametrize("case", list(BASELINES))
def test_baseline_matches_single_and_theory(case, request, pools, tmp_path):
    preset, llama = case.removesuffix("-llama"), case.endswith("-llama")
    run = pools.run(2, tiny_settings([f"parallel={preset}", "train.save_final=true", *BASELINES[case]]),
                    tmp_path / "run")
    s = assert_ok(run)
    check_matches_single(run, request.getfixturevalue("single_run_llama" if llama else "single_run"))
    # torch_tp: DTensor's own count (6L+2 all-reduces and a logits all-gather per microbatch),
    # more than Megatron's; torch_pp: exactly our pipeline's sends; accelerate_ddp: dp's all-reduce.
    assert s["comm_matches_theory"], (s["comm"]["sent_bytes_per_step"], s["expected_comm"]["sent_bytes_per_step"])
    assert s["comm"]["sent_bytes_per_step"] > 0
    # MFU is the formula on the run's own figures (its size against the peak is the machine's business:
    # a peak measured while other jobs hold the cores is too low).
    m = s["mfu"]
    assert m["mfu"] > 0 and m["mfu"] == m["flops_per_token"] * s["tokens_per_s"] / (m["peak_flops"] * m["devices"])
    if preset == "torch_tp":
        # Measured, not assumed: DTensor's plan moves more than the hand-written tp's theory.
        megatron = expected_comm("tp", model_config(OmegaConf.create(s["config"]["model"])),
                                 ParallelDims.resolve(2, dp=1, tp=2, pp=1), microbatch_size=16, microbatches=1)
        assert s["comm"]["sent_bytes_per_step"] > megatron["sent_bytes_per_step"]
        assert s["comm"]["by_op"]["all_gather"]["calls"] == 2  # the full logits, once per rank

