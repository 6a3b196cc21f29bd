"""parallel/report/mfu.py: the FLOPs-per-token formula, the measured peak, the ratio."""

import math

import torch

from parallel.core.model import GPT, GPTConfig
from parallel.report.mfu import devices_for_peak, flops_per_token, matmul_parameters, measure_peak_flops, mfu


def tiny() -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=32, n_layers=4, d_model=64, n_heads=4, mlp_ratio=4, dropout=0.0,
                     vocab_pad_multiple=64)


def test_matmul_parameters_are_the_model_without_its_embedding_tables():
    cfg = tiny()
    model = GPT(cfg, seed=0)
    counted = sum(p.numel() for n, p in model.named_parameters() if n not in ("embed.tok.weight", "embed.pos.weight"))
    assert {n for n, _ in model.named_parameters()} >= {"embed.tok.weight", "embed.pos.weight"}
    assert matmul_parameters(cfg) == counted


def test_flops_per_token_by_hand_for_the_tiny_model():
    # L=4, h=64, f=256, V=256, s=32. Per layer: 4h²+4h + 2fh+f+h + 4h = 16384+256 + 32768+256+64 + 256;
    # plus final norm 2h = 128 and head V·h = 16384.
    n = 4 * (16384 + 256 + 32768 + 256 + 64 + 256) + 128 + 16384
    assert matmul_parameters(tiny()) == n
    assert flops_per_token(tiny()) == 6 * n + 12 * 4 * 64 * 32


def test_peak_is_a_plausible_measured_rate():
    peak = measure_peak_flops(torch.device("cpu"), size=256, repeats=2, min_seconds=0.05)
    assert math.isfinite(peak) and 1e7 < peak < 1e14


def test_mfu_is_model_flops_over_peak_times_devices():
    cfg = tiny()
    assert mfu(cfg, tokens_per_s=1000.0, peak_flops_per_device=1e12, devices=2) == flops_per_token(cfg) * 1000.0 / 2e12
    assert devices_for_peak(torch.device("cpu"), 4) == 1
    assert devices_for_peak(torch.device("cuda", 0), 4) == 4


def test_peak_is_measured_in_the_compute_dtype():
    """Under train.precision=bf16 the matmuls run in bf16, so the peak MFU divides by must be bf16's
    (on a GPU about 15 times fp32's): the matmuls the measurement runs are seen in that dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("mm"):
                self.seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    for dtype in (torch.float32, torch.bfloat16):
        with MatmulDtypes() as seen:
            peak = measure_peak_flops(torch.device("cpu"), size=64, repeats=1, min_seconds=0.0, dtype=dtype)
        assert seen.seen == {dtype} and peak > 0


def test_a_bf16_run_divides_by_the_bf16_peak(pools, tmp_path):
    from launcher import TINY, assert_ok

    args = [a for a in TINY if not a.startswith("train.peak_flops")] + ["train.precision=bf16", "train.steps=2"]
    summary = assert_ok(pools.run(1, [*args, "parallel=single"], tmp_path / "bf16"))
    assert summary["mfu"]["peak_dtype"] == "bf16" and summary["mfu"]["peak_measured"] is True
