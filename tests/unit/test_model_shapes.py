"""The one model in its shapes: GPT-2's block and Llama's (GQA, SwiGLU, RMSNorm, RoPE, no bias, tied or not).

The closed-form parameter counts (ModelShape, algebra) against the built model's tensors; each
new piece against the textbook computation it replaces; bad shapes refused in one line.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from parallel.algebra import parameter_count
from parallel.core.config import GPTConfig
from parallel.core.model import GPT, count_parameters
from parallel.core.rotary import Rotary, rotate_half
from parallel.core.shape import ModelShape, ShapeError

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
TINY_LLAMA = GPTConfig(**yaml.safe_load((CONF / "tiny_llama.yaml").read_text()))

SHAPES = {
    "gpt2": GPTConfig(),
    "tiny_llama": TINY_LLAMA,
    "mqa": replace(TINY_LLAMA, n_kv_heads=1),
    "mha_rope": replace(TINY_LLAMA, n_kv_heads=None),
    "tied": replace(TINY_LLAMA, tied_head=True),
    "bias_layernorm": replace(TINY_LLAMA, bias=True, norm="layernorm"),
    "gelu_wide": GPTConfig(ffn_hidden=96),
    "llama_moe": replace(TINY_LLAMA, moe_experts=4, moe_top_k=2, moe_every=2),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_closed_form_counts_equal_the_built_model(name):
    cfg = SHAPES[name]
    model = GPT(cfg)
    assert count_parameters(model) == parameter_count(cfg)
    shape = ModelShape(cfg)
    if not cfg.moe_experts:
        assert count_parameters(model) == shape.parameter_count()
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.1."))
    assert blocks == shape.layer_parameters() or cfg.is_moe_block(1)


def test_llama_block_has_the_pieces_it_names():
    model = GPT(TINY_LLAMA)
    block = model.blocks[0]
    assert isinstance(block.ln1, torch.nn.RMSNorm) and block.mlp.gate is not None
    assert block.attn.k.weight.shape == (TINY_LLAMA.kv_width, TINY_LLAMA.d_model)
    assert block.attn.q.bias is None and model.embed.pos is None and block.attn.rotary is not None
    assert model.head.out.weight is not model.embed.tok.weight
    tied = GPT(replace(TINY_LLAMA, tied_head=True))
    assert tied.head.out.weight is tied.embed.tok.weight
    assert "head.out.weight" not in dict(tied.named_parameters())


def test_gpt2_shape_is_built_as_before():
    """The default fields draw the same numbers in the same order as the GPT-2 model always did."""
    cfg = GPTConfig()
    assert cfg.is_gpt2_shape and not TINY_LLAMA.is_gpt2_shape
    model = GPT(cfg, seed=3)
    names = [n for n, _ in model.named_parameters()]
    assert names[:3] == ["embed.tok.weight", "embed.pos.weight", "blocks.0.ln1.weight"]
    assert "blocks.0.mlp.gate.weight" not in names


def test_grouped_query_attention_equals_repeated_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    model = GPT(TINY_LLAMA)
    out = model.blocks[0].attn.core(q, k, v)
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, expanded)


def test_swiglu_is_silu_gate_times_up_then_down():
    mlp = GPT(TINY_LLAMA).blocks[0].mlp
    x = torch.randn(3, 5, TINY_LLAMA.d_model)
    expected = (F.silu(x @ mlp.gate.weight.T) * (x @ mlp.fc.weight.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_rope_scores_depend_on_relative_position_only():
    rotary = Rotary(16, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(p, p2):
        rotary.positions = lambda length, device: torch.tensor([p])
        rq, _ = rotary(q, k)
        rotary.positions = lambda length, device: torch.tensor([p2])
        _, rk = rotary(q, k)
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_rope_rotation_and_its_backward_match_the_textbook_formula():
    rotary = Rotary(8, 500000.0)
    q = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 6, 8, dtype=torch.float64, requires_grad=True)
    rq, rk = rotary(q, k)
    cos, sin = (t.double() for t in rotary.angles(6, "cpu"))
    reference = q * cos + rotate_half(q) * sin
    torch.testing.assert_close(rq, reference.float().double(), atol=1e-6, rtol=1e-6)
    weights = torch.randn_like(rq)
    (rq * weights).sum().backward()
    q2 = q.detach().clone().requires_grad_(True)
    ((q2 * cos.float().double() + rotate_half(q2) * sin.float().double()) * weights).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)
    assert rk.shape == k.shape


@pytest.mark.parametrize("fields,message", [
    ({"n_kv_heads": 3}, r"model.n_kv_heads=3 does not divide model.n_heads=4: .* choose one of \[1, 2, 4\]"),
    ({"n_kv_heads": 0}, r"model.n_kv_heads=0 does not divide"),
    ({"gated_mlp": True}, r"model.gated_mlp=true needs model.ffn_hidden.*model.ffn_hidden=192"),
    ({"position_embedding": "rope", "d_model": 60, "n_heads": 4},
     r"head dimension d_model / n_heads = 60 / 4 = 15 is odd"),
    ({"norm": "batchnorm"}, r"model.norm='batchnorm': choose one of layernorm, rmsnorm"),
    ({"position_embedding": "alibi"}, r"model.position_embedding='alibi': choose one of learned, rope"),
    ({"position_embedding": "rope", "rope_base": 1}, r"model.rope_base=1 must be a finite number above 1"),
    ({"bias": "no"}, r"model.bias='no' must be true or false"),
])
def test_bad_shapes_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as caught:
        GPTConfig(**fields)
    assert "\n" not in str(caught.value)
    with pytest.raises(ShapeError, match=message):
        ModelShape.from_preset(fields)


def _plan(*overrides: str):
    from hydra import compose, initialize_config_dir
    from launcher import PROJECT_ROOT

    from parallel.dist.groups import LaunchEnv
    from parallel.run_plan import build_plan

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return build_plan(cfg, LaunchEnv(rank=0, world_size=1, local_world_size=1), cuda_available=False)


def test_launch_builds_every_llama_preset_and_refuses_bad_fields_before_any_group():
    from parallel.run_plan import ConfigError

    plan = _plan("model=small_llama")
    assert plan.model.kv_heads == 2 and plan.model.gated_mlp and plan.model.rope and not plan.model.bias
    assert _plan("model=llama3_8b").model.kv_heads == 8  # no refusal for the architecture
    for override, message in (("model.n_kv_heads=3", r"model.n_kv_heads=3 does not divide model.n_heads=4"),
                              ("model.ffn_hidden=null", r"model.gated_mlp=true needs model.ffn_hidden"),
                              ("model.rope_base=0.5", r"model.rope_base=0.5 must be a finite number above 1")):
        with pytest.raises(ConfigError, match=message):
            _plan("model=tiny_llama", override)
