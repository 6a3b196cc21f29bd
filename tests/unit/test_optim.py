import pytest
import torch

from parallel.core.model import GPT, GPTConfig, token_loss_sum
from parallel.core.optim import AdamW
from parallel.strategy import make_optimizer


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_equals_torch_adamw_step_by_step(weight_decay):
    cfg = GPTConfig(seq_len=16, n_layers=2, d_model=32, n_heads=2)
    ours_model, ref_model = GPT(cfg, seed=1), GPT(cfg, seed=1)
    ours = AdamW([{"params": ours_model.parameters(), "weight_decay": weight_decay}], lr=1e-2, betas=(0.9, 0.95),
                 eps=1e-8)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=weight_decay, foreach=False)
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
