import pytest
import torch

from parallel.core.model import GPT, GPTConfig, token_loss_sum
from parallel.core.optim import SGD, AdamW
from parallel.strategy import make_optimizer


def _pair(kind: str, weight_decay: float, ours_params, ref_params):
    """Ours and torch's optimizer of one kind (torch's SGD decays as L2, not decoupled: compared without decay)."""
    if kind == "sgd":
        return (SGD([{"params": ours_params, "weight_decay": 0.0}], lr=1e-2),
                torch.optim.SGD(ref_params, lr=1e-2, foreach=False))
    return (AdamW([{"params": ours_params, "weight_decay": weight_decay}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8),
            torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                              foreach=False))


@pytest.mark.parametrize("kind,weight_decay", [("adamw", 0.0), ("adamw", 0.1), ("sgd", 0.0)])
def test_ours_equal_torchs_step_by_step(kind, weight_decay):
    cfg = GPTConfig(seq_len=16, n_layers=2, d_model=32, n_heads=2)
    ours_model, ref_model = GPT(cfg, seed=1), GPT(cfg, seed=1)
    ours, ref = _pair(kind, weight_decay, ours_model.parameters(), ref_model.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        idx = torch.randint(0, 256, (4, 16), generator=gen)
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            token_loss_sum(model(idx), idx).backward()
            opt.step()
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_no_decay_on_biases_and_norms_and_state_bytes():
    model = GPT(GPTConfig(seq_len=16, n_layers=1, d_model=32, n_heads=2))
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    idx = torch.randint(0, 256, (2, 16))
    token_loss_sum(model(idx), idx).backward()
    opt.step()
    assert opt.state_bytes() == 2 * 4 * sum(p.numel() for p in model.parameters())  # fp32 Adam: 8 bytes/param
