"""The GPU paths' decisions, proven on the CPU; what only a GPU can show is marked `gpu`.

Each test here holds the part of a CUDA code path that a CPU can reach: which clock a call is
timed by, what is reset and when, which verdict a run may claim on CUDA. The tests marked `gpu`
run the same functions on a GPU (`launch/gpu_check.sh` runs them) and skip with their reason
elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from parallel.report.metrics import peak_memory_bytes, peak_memory_scope, reset_peak_memory

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; none is visible on this machine")


def _refuse(*_args, **_kwargs):
    raise AssertionError("a CUDA function was called on the CPU path")


# -- the peak memory is the timed steps' ------------------------------------------------------------
def test_the_peak_reset_is_a_no_op_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", _refuse)
    before = peak_memory_bytes(torch.device("cpu"))
    assert reset_peak_memory(torch.device("cpu")) is False
    assert peak_memory_bytes(torch.device("cpu")) >= before  # the peak RSS only grows
    assert peak_memory_scope("cpu").startswith("the whole process")
    assert peak_memory_scope("cuda").startswith("the timed steps")


@pytest.mark.gpu
@needs_gpu
def test_the_peak_reset_forgets_what_came_before_on_cuda():
    device = torch.device("cuda", 0)
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    del big
    assert peak_memory_bytes(device) >= 64 * 2**20
    assert reset_peak_memory(device) is True
    assert peak_memory_bytes(device) == torch.cuda.memory_allocated(device) < 64 * 2**20


# -- the activation check: against the CPU kernel's saved tensors, or not at all -------------------
def _memory(device_type: str, measured: int, formula: int) -> dict:
    from parallel.activations import activation_check_note
    from parallel.report.summary import summarize_memory

    state = {"param_bytes": 1, "grad_bytes": 1, "optimizer_bytes": 2, "peak_model_state_bytes": 4}
    report = {"rank": 0, "model_state": state, "activation_peak_bytes": measured, "peak_memory_bytes": 10}
    return summarize_memory([report], None, [formula], activation_check_note(device_type))


def test_the_activation_formula_is_held_to_the_cpu_kernel_and_not_claimed_on_cuda():
    assert _memory("cpu", 100, 100)["activations_match_theory"] is True
    assert _memory("cpu", 100, 101)["activations_match_theory"] is False
    assert _memory("cpu", 100, 100)["activations_check_note"] is None
    cuda = _memory("cuda", 100, 101)
    # Not false: the formula does not describe what CUDA's attention kernels save.
    assert cuda["activations_match_theory"] is None
    assert cuda["activations_check_note"].startswith("not checked on CUDA: ")
    assert cuda["activations_bytes_measured"] == [100] and cuda["theory"]["activation_bytes"] == [101]
