import pytest
import torch

from parallel.algebra import parameter_count
from parallel.core.model import GPT, GPTConfig, count_parameters, token_loss_sum

TINY = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)
PRESETS = {
    "tiny": TINY,
    "small": GPTConfig(seq_len=128, n_layers=8, d_model=256, n_heads=8),
    "gpt2": GPTConfig(seq_len=1024, n_layers=12, d_model=768, n_heads=12),
}


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_parameter_count_matches_the_closed_form(name):
    cfg = PRESETS[name]
    V, h, s, L = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers
    # docs/theory/parameters.md: Ψ = V·h + s·h + L·(12h² + 13h) + 2h + V·h (untied head)
    formula = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h + V * h
    assert count_parameters(GPT(cfg)) == formula == parameter_count(cfg)


def test_gpt2_preset_parameter_count():
    # GPT-2 small's shape with a byte vocabulary and an untied head: 86.2M parameters.
    assert count_parameters(GPT(PRESETS["gpt2"])) == parameter_count(PRESETS["gpt2"]) == 86_235_648


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = GPT(TINY, seed=3), GPT(TINY, seed=3), GPT(TINY, seed=4)
    torch.manual_seed(999)  # the global RNG must not matter
    d = GPT(TINY, seed=3)
    for (name, pa), pb, pc, pd in zip(a.named_parameters(), b.parameters(), c.parameters(), d.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pd), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_forward_shape_and_causality():
    model = GPT(TINY, seed=0)
    idx = torch.randint(0, 256, (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, TINY.padded_vocab_size)
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    # Tokens after position 20 changed: logits up to 19 must not move (causal attention).
    assert torch.allclose(model(changed)[:, :20], logits[:, :20], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 20:], logits[:, 20:])


def test_initial_loss_is_near_uniform():
    model = GPT(TINY, seed=0)
    idx = torch.randint(0, 256, (4, 32))
    loss = token_loss_sum(model(idx), idx) / idx.numel()
    assert abs(float(loss.detach()) - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_bad_model_config_is_refused():
    with pytest.raises(ValueError, match=r"model.d_model=64 is not divisible by model.n_heads=5"):
        GPTConfig(d_model=64, n_heads=5)
    with pytest.raises(ValueError, match=r"model.n_layers=0 must be a positive integer"):
        GPTConfig(n_layers=0)
