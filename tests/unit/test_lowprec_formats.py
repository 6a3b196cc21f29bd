"""parallel.comm_dtype's formats (parallel/sync/quantize.py) and the option's refusals: fast, one process.

  * a packed chunk is exactly the closed form's bytes (algebra.wire_bytes), scales included;
  * every element comes back within the format's stated bound, and the bound is tight enough
    that some element reaches a third of it;
  * a block of zeros comes back as zeros, and blocks of very different magnitudes each keep their
    own precision (the point of a scale per block); a block of subnormal values comes back finite;
  * the byte factor the planner reads: 1, 1/2, 65/256, 65/256;
  * a format is refused by name where it means nothing, before any process group.
"""

from fractions import Fraction

import pytest
import torch
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT

from parallel.algebra import comm_dtype_factor, wire_bytes
from parallel.dist.groups import LaunchEnv
from parallel.run_plan import ConfigError, build_plan
from parallel.sync.quantize import error_bound, pack, unpack


def plan_for(world: int, *overrides: str):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", *overrides])
    return build_plan(cfg, LaunchEnv(rank=0, world_size=world, local_world_size=world), cuda_available=False)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000])
def test_a_chunk_is_its_closed_form_and_within_its_bound(fmt, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    packed = pack(x, fmt)
    assert packed.dtype == torch.uint8 and packed.numel() == wire_bytes(fmt, numel)
    err, bound = (unpack(packed, fmt, numel) - x).abs(), error_bound(x, fmt)
    assert (err <= bound * (1 + 1e-6)).all()
    if numel >= 255:
        assert (err / bound).max() > 1 / 3


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_each_block_keeps_its_own_scale(fmt):
    x = torch.cat([torch.zeros(256), torch.full((256,), 1e-6), torch.full((256,), 1e3)])
    x[256] = 2e-6
    back = unpack(pack(x, fmt), fmt, x.numel())
    assert back[:256].eq(0).all()
    assert torch.allclose(back[257:512], x[257:512], rtol=0.07)  # a tiny block's 1e-6 survives beside 1e3


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_block_of_subnormal_values_comes_back_finite(fmt):
    """absmax / 448 of a block whose largest value is 1e-44 underflows to 0: the scale's floor keeps
    the codes finite (a run with fp8 error feedback met such a block and turned NaN without it)."""
    x = torch.zeros(256)
    x[:3] = torch.tensor([1e-44, -3e-45, 1e-45])
    back = unpack(pack(x, fmt), fmt, 256)
    assert torch.isfinite(back).all() and ((back - x).abs() <= error_bound(x, fmt) * (1 + 1e-6)).all()


def test_the_byte_factor_of_each_format():
    assert [comm_dtype_factor(f) for f in ("fp32", "bf16", "int8", "fp8")] == \
        [1, Fraction(1, 2), Fraction(65, 256), Fraction(65, 256)]
    assert wire_bytes("bf16", 1001) == 2002 and wire_bytes("int8", 257) == 257 + 8


@pytest.mark.parametrize("overrides,words", [
    (["parallel=dp", "parallel.comm_dtype=fp16"], "parallel.comm_dtype='fp16': choose one of fp32, bf16, fp8, int8"),
    (["parallel=torch_ddp", "parallel.comm_dtype=int8"], "bf16 compression hook"),
    (["parallel=tp", "parallel.tp=2", "parallel.comm_dtype=bf16"], "fp32 only"),
    (["parallel=dp_naive", "parallel.comm_dtype=fp8"], "use parallel.grad_sync=bucketed"),
])
def test_a_format_is_refused_where_it_means_nothing(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_for(2, *overrides)


@pytest.mark.parametrize("preset", ["dp", "zero1", "zero2", "zero3", "torch_ddp"])
def test_the_formats_are_accepted_where_they_are_read(preset):
    assert plan_for(2, f"parallel={preset}", "parallel.comm_dtype=bf16") is not None
