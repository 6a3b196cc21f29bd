"""What Llama's pieces save for backward, and that saving less changes no number.

* parallel/core/norm.py's RMSNorm equals torch's nn.RMSNorm (forward bit for bit, gradients within
  rounding) in fp32 and with bf16 inputs, and saves only its input and the fp32 1/rms per token.
* parallel/core/rotary.py's rotation saves nothing (its angles are computed again in backward from the
  positions), and its gradients equal autograd's through the textbook rotation, context-parallel
  positions included.
* parallel/activations.py's terms for these pieces, measured by the ActivationMeter on one block, and on
  one tensor-parallel rank's shard of it (built by hand: K and V of the rank's kv heads, split or
  replicated).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

from parallel import activations
from parallel.core.config import GPTConfig
from parallel.core.model import Block
from parallel.core.norm import RMSNorm
from parallel.core.rotary import Rotary, rotate_half
from parallel.core.shape import ModelShape
from parallel.dist.dims import ParallelDims
from parallel.layout import Cut
from parallel.registry import layout_of
from parallel.report.activations import ActivationMeter

TINY_LLAMA = GPTConfig(**yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/model/tiny_llama.yaml")
                                        .read_text()))


def _measured(run, *inputs) -> int:
    """Bytes saved for backward by `run(*inputs)` (the meter's peak, the inputs' own storages included
    where an op saves them)."""
    meter = ActivationMeter()
    with meter.step():
        out = run(*inputs)
        held = meter.current
    del out
    return held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_torch_and_saves_its_input_and_one_over_rms(dtype):
    h = 24
    ours, theirs = RMSNorm(h, eps=1e-5), torch.nn.RMSNorm(h, eps=1e-5)
    with torch.no_grad():
        weight = torch.randn(h, generator=torch.Generator().manual_seed(1))
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = torch.randn(3, 5, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    grad = torch.randn(3, 5, h, generator=torch.Generator().manual_seed(3))
    outputs, grads = [], []
    for norm in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = norm(xi)
        (y.float() * grad).sum().backward()
        outputs.append(y)
        grads.append((xi.grad, norm.weight.grad))
    assert outputs[0].dtype == outputs[1].dtype and torch.equal(outputs[0], outputs[1])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    saved = _measured(ours, x.clone().requires_grad_(True))
    assert saved == x.numel() * x.element_size() + 3 * 5 * 4  # the input, and 1/rms in fp32 per token
    assert _measured(theirs, x.clone().requires_grad_(True)) > saved  # torch's composite keeps x/rms too


def test_rotary_saves_nothing_and_its_gradient_is_the_textbook_rotation():
    rotary = Rotary(8, 10000.0)
    rotary.positions = lambda length, device: torch.arange(length, device=device) * 3 + 5  # a cp rank's positions
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    assert _measured(rotary, q, k) == 0
    rq, rk = rotary(q, k)
    wq, wk = torch.randn_like(rq), torch.randn_like(rk)
    ((rq * wq).sum() + (rk * wk).sum()).backward()
    cos, sin = rotary.tables(q)
    q2, k2 = (t.detach().clone().requires_grad_(True) for t in (q, k))
    (((q2 * cos + rotate_half(q2) * sin) * wq).sum() + ((k2 * cos + rotate_half(k2) * sin) * wk).sum()).backward()
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(k.grad, k2.grad)


def _block_saves(block: Block, cfg: GPTConfig, b: int) -> int:
    """Bytes one forward of `block` on b sequences saves for backward (its parameters left out)."""
    x = torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True)
    meter = ActivationMeter(block.parameters())
    with meter.step():
        y = block(x)
        held = meter.current
    del y
    return held


@pytest.mark.parametrize("cfg", [TINY_LLAMA, replace(TINY_LLAMA, n_kv_heads=1, gated_mlp=False, ffn_hidden=96)],
                         ids=["tiny_llama", "mqa_gelu"])
def test_one_llama_block_saves_its_formula(cfg):
    # The block's input is ln1's input: counted once, as the formula's `ln1` term.
    assert _block_saves(Block(cfg), cfg, 2) == activations.block_saved_bytes(cfg, Cut(b=2, t=1, cp=1, act_bytes=4))


def _tp_rank_block(cfg: GPTConfig, t: int) -> Block:
    """What one of t tensor-parallel ranks computes of a Llama block, without sequence parallelism, built
    by hand: Q of h/t columns, K and V of this rank's kv heads (`kv_width_per_rank`: split, or one head
    replicated), the output projection's h/t input rows, gate and up of f/t columns, down's f/t rows. The
    all-reduces after the row-parallel linears save nothing, so they are left out."""
    shape, h, f = ModelShape(gpt=cfg), cfg.d_model, cfg.d_ff
    block = Block(cfg)
    attn, mlp = block.attn, block.mlp
    attn.q, attn.proj = nn.Linear(h, h // t, bias=False), nn.Linear(h // t, h, bias=False)
    attn.k, attn.v = (nn.Linear(h, shape.kv_width_per_rank(t), bias=False) for _ in range(2))
    mlp.fc, mlp.gate, mlp.proj = nn.Linear(h, f // t, bias=False), nn.Linear(h, f // t, bias=False), \
        nn.Linear(f // t, h, bias=False)
    return block


@pytest.mark.parametrize("t", [2, 4])
def test_a_tensor_parallel_ranks_block_saves_its_formula(t):
    """tiny_llama's 2 kv heads split at t = 2 and replicated at t = 4: the rank's K and V are its kv heads.
    (With sequence parallelism the rank also saves its all-gathers' outputs: measured by the tp runs.)"""
    assert _block_saves(_tp_rank_block(TINY_LLAMA, t), TINY_LLAMA, 2) == \
        activations.block_saved_bytes(TINY_LLAMA, Cut(b=2, t=t, act_bytes=4))


def test_a_bf16_run_has_no_activation_formula_rather_than_a_wrong_one():
    layout = layout_of(ParallelDims.resolve(1), microbatch_size=16, precision="bf16")
    assert activations.registry_activations(TINY_LLAMA, layout) is None
    assert activations.registry_activations(TINY_LLAMA, replace(layout, precision="fp32")) is not None
