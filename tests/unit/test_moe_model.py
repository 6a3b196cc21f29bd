"""The mixture-of-experts model in one process: the dense model untouched, routing (gates, capacity,
drop order, balancing loss) against hand computations, the loss adding up over any split of the
batch, the parameter count against its closed form, and a few steps of training."""

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import yaml

from parallel.algebra import active_parameter_count, parameter_count, part_parameter_counts, tp_shard_parameter_count
from parallel.core.model import (
    GPT,
    MLP,
    MOE_FIELDS,
    GPTConfig,
    MoEMLP,
    count_parameters,
    moe_aux_loss_sum,
    token_loss_sum,
    training_loss_sum,
)
from parallel.core.optim import AdamW
from parallel.core.routing import expert_capacity, route
from parallel.moe.expert_parallel import shard_experts
from parallel.moe.theory import ep_shard_parameter_count

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
TINY = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)
TINY_MOE = replace(TINY, moe_experts=4, moe_top_k=2, moe_every=2)
# Smaller still, for the tests that run many forward and backward passes.
MINI_MOE = GPTConfig(seq_len=16, n_layers=2, d_model=32, n_heads=2, moe_experts=4, moe_top_k=2, moe_every=1)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: a second intra-op thread only contends with the other tests' processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the dense model is the dense model ---------------------------------------------------------
def test_moe_settings_without_experts_change_nothing():
    dense = GPT(TINY, seed=5)
    ignored = GPT(replace(TINY, moe_experts=0, moe_top_k=3, moe_every=2, moe_capacity_factor=0.5, moe_aux_weight=1.0),
                  seed=5)
    assert all(type(block.mlp) is MLP for block in ignored.blocks)
    a, b = dense.state_dict(), ignored.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = ignored(idx)
    assert torch.equal(dense(idx), logits)
    assert moe_aux_loss_sum(ignored) is None
    assert torch.equal(training_loss_sum(ignored, logits, idx), token_loss_sum(logits, idx))


def test_experts_leave_the_dense_parts_as_they_were():
    """Only MoE blocks' MLPs differ: the parameters drawn before the first MoE block are the dense
    model's (the private generator draws in module order)."""
    dense, moe = GPT(TINY, seed=2).state_dict(), GPT(replace(TINY_MOE, moe_every=4), seed=2).state_dict()
    # moe_every=4: only block 0 has experts; the embedding and block 0's attention come first.
    for name in ("embed.tok.weight", "embed.pos.weight", "blocks.0.attn.q.weight", "blocks.0.attn.proj.weight"):
        assert torch.equal(dense[name], moe[name]), name
    assert "blocks.0.mlp.router.weight" in moe and "blocks.1.mlp.fc.weight" in moe
    assert "blocks.0.mlp.fc.weight" not in moe


@pytest.mark.parametrize("every,blocks", [(1, (0, 1, 2, 3)), (2, (0, 2)), (3, (0, 3)), (5, (0,))])
def test_which_blocks_have_experts(every, blocks):
    cfg = replace(TINY_MOE, moe_every=every)
    assert cfg.moe_blocks == blocks
    assert tuple(i for i, b in enumerate(GPT(cfg).blocks) if isinstance(b.mlp, MoEMLP)) == blocks


# -- routing --------------------------------------------------------------------------------------
def test_capacity_is_exact():
    assert expert_capacity(32, 1, 4, 1.25) == 10
    assert expert_capacity(32, 2, 4, 1.25) == 20
    # 1.1 · 50 is 55 exactly; in floating point it is 55.00000000000001, whose ceiling is 56.
    assert math.ceil(1.1 * 50) == 56 and expert_capacity(50, 1, 1, 1.1) == 55
    assert expert_capacity(32, 1, 3, 2) == 22


def _logits(prefs: list[list[int]], experts: int) -> torch.Tensor:
    """(1, s, E) logits whose order of preference per token is `prefs[t]` (best first)."""
    logits = torch.zeros(1, len(prefs), experts)
    for t, order in enumerate(prefs):
        for rank, e in enumerate(order):
            logits[0, t, e] = 3.0 - rank
    return logits


def test_top1_drops_past_capacity_in_position_order():
    # 6 tokens, 3 experts, capacity 1·6·1/3 = 2: tokens 0, 1, 2, 4 choose expert 0, so tokens 2
    # and 4 are dropped (the first two in position order are kept).
    logits = _logits([[0, 1, 2], [0, 2, 1], [0, 1, 2], [1, 0, 2], [0, 1, 2], [2, 0, 1]], 3)
    r = route(logits, top_k=1, capacity=expert_capacity(6, 1, 3, 1.0))
    assert r.routed.tolist() == [4, 1, 1] and r.counts.tolist() == [2, 1, 1] and r.dropped == 2
    assert r.token.tolist() == [0, 1, 3, 5] and r.expert.tolist() == [0, 0, 1, 2]
    probs = logits.softmax(-1)[0]
    # Top-1 keeps the raw router probability (Switch), not 1.
    assert torch.allclose(r.weight, probs[[0, 1, 3, 5], [0, 0, 1, 2]])


def test_top2_second_choices_queue_after_every_first_choice():
    # 4 tokens, 3 experts, k = 2, capacity ceil(0.75·4·2/3) = 2. First choices: 0, 0, 1, 0 ->
    # expert 0 keeps tokens 0, 1 and drops token 3's first choice. Second choices: 1, 1, 0, 1 ->
    # expert 1 already holds token 2's first choice, so it keeps token 0's second choice only;
    # expert 0 is full, so token 2's second choice is dropped.
    logits = _logits([[0, 1, 2], [0, 1, 2], [1, 0, 2], [0, 1, 2]], 3)
    r = route(logits, top_k=2, capacity=expert_capacity(4, 2, 3, 0.75))
    assert r.routed.tolist() == [4, 4, 0] and r.counts.tolist() == [2, 2, 0] and r.dropped == 4
    assert list(zip(r.expert.tolist(), r.token.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 2)]
    # k >= 2 renormalises the chosen probabilities (GShard, Mixtral): token 0 has 1/(1+e^-1) on
    # its best expert whatever the third logit.
    assert torch.allclose(r.weight[0], torch.tensor(1 / (1 + math.exp(-1))))


def test_routing_is_a_function_of_each_sequence_alone():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 16, 4, generator=gen) * 3
    capacity = expert_capacity(16, 2, 4, 0.75)
    whole = route(logits, 2, capacity)
    parts = [route(logits[i:i + 2], 2, capacity) for i in (0, 2, 4)]
    assert whole.dropped > 0  # the check must include drops
    assert torch.equal(whole.counts, sum(p.counts for p in parts))
    kept = {(e, t) for e, t in zip(whole.expert.tolist(), whole.token.tolist())}
    assert kept == {(e, t + 32 * i) for i, p in enumerate(parts) for e, t in zip(p.expert.tolist(), p.token.tolist())}
    assert torch.allclose(whole.aux_sum, sum(p.aux_sum for p in parts), rtol=1e-6)


def test_balancing_loss_is_switch_formula_per_sequence():
    gen = torch.Generator().manual_seed(2)
    b, s, E, k = 3, 8, 4, 2
    logits = torch.randn(b, s, E, generator=gen) * 2
    r = route(logits, k, capacity=1)  # capacity does not enter the loss: f counts before dropping
    expected = 0.0
    for seq in logits.softmax(-1):
        chosen = seq.topk(k, dim=-1).indices
        f = [float((chosen == e).sum()) / (s * k) for e in range(E)]
        P = [float(seq[:, e].mean()) for e in range(E)]
        expected += s * E * sum(fe * pe for fe, pe in zip(f, P))
    assert r.aux_sum.item() == pytest.approx(expected, rel=1e-6)
    # Uniform probabilities and perfectly balanced choices give 1 per sequence (Switch's optimum).
    balanced = torch.zeros(1, 4, 4)
    balanced[0, torch.arange(4), torch.arange(4)] = 1e-4
    assert route(balanced, 1, 4).aux_sum.item() == pytest.approx(4 * 1.0, rel=1e-3)


class _FixedRouter(nn.Module):
    """Stands in for the router's linear map: the logits are the test's input, not under test."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return self.logits


def test_dropped_tokens_leave_the_layer_as_zeros():
    cfg = replace(TINY_MOE, d_model=8, n_heads=2, moe_experts=3, moe_top_k=1, moe_capacity_factor=1.0)
    layer = GPT(cfg, seed=0).blocks[0].mlp
    logits = _logits([[0, 1, 2], [0, 2, 1], [0, 1, 2], [1, 0, 2], [0, 1, 2], [2, 0, 1]], 3)
    layer.router = _FixedRouter(logits)
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(3))
    y = layer(x)
    assert torch.equal(y[0, 2], torch.zeros(8)) and torch.equal(y[0, 4], torch.zeros(8))
    probs = logits.softmax(-1)[0]
    for t, e in ((0, 0), (1, 0), (3, 1), (5, 2)):
        assert torch.allclose(y[0, t], probs[t, e] * layer.experts[e](x[0, t]), atol=1e-7)
    assert layer.kept_counts.tolist() == [2, 1, 1] and layer.routed_counts.tolist() == [4, 1, 1]


def test_router_runs_in_fp32_under_bf16_autocast():
    layer = GPT(TINY_MOE, seed=0).blocks[0].mlp
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(8))
    layer(x)
    reference = (layer.aux_loss_sum.clone(), layer.kept_counts.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16  # the experts do run in bf16
    assert torch.equal(layer.aux_loss_sum, reference[0]) and torch.equal(layer.kept_counts, reference[1])


def test_balancing_loss_reaches_the_router_and_what_feeds_it_never_the_experts():
    model = GPT(replace(TINY_MOE, moe_every=4), seed=0)  # one MoE block: block 0
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    model(idx)
    moe_aux_loss_sum(model).backward()
    feeds_router = ("embed.", "blocks.0.ln1.", "blocks.0.attn.", "blocks.0.ln2.", "blocks.0.mlp.router.")
    for name, p in model.named_parameters():
        touched = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert touched == name.startswith(feeds_router), name


# -- the loss means the same however the batch is split -------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2])
def test_loss_and_gradients_add_up_over_microbatches(top_k):
    """Σ over microbatches of training_loss_sum / global tokens, and its gradients, are the whole
    batch's: the balancing loss and the drops are per sequence, so no split changes them. What
    makes data- and expert-parallel runs match the single run."""
    cfg = replace(MINI_MOE, moe_top_k=top_k, moe_capacity_factor=0.75, moe_aux_weight=0.1)
    idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(5))
    tokens = idx.numel()
    results = []
    for size in (4, 2, 1):
        model = GPT(cfg, seed=1)
        loss, dropped = 0.0, 0
        for mb in idx.split(size):
            part = training_loss_sum(model, model(mb), mb) / tokens
            part.backward()
            loss += part.item()
            dropped += sum(int(b.mlp.routed_counts.sum() - b.mlp.kept_counts.sum())
                           for b in model.blocks if isinstance(b.mlp, MoEMLP))
        results.append((loss, dropped, {n: p.grad for n, p in model.named_parameters()}))
    whole_loss, whole_dropped, whole_grads = results[0]
    assert whole_dropped > 0
    for loss, dropped, grads in results[1:]:
        assert dropped == whole_dropped
        assert loss == pytest.approx(whole_loss, rel=1e-6)
        for name, g in grads.items():
            assert torch.allclose(g, whole_grads[name], rtol=1e-5, atol=1e-7), name


def test_the_moe_model_trains():
    model = GPT(MINI_MOE, seed=0)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    optimizer = AdamW([{"params": decay, "weight_decay": 0.1},
                       {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3)
    idx = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(6))
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        loss = training_loss_sum(model, model(idx[:, :-1].contiguous()), idx[:, 1:].contiguous()) / idx[:, 1:].numel()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0  # memorising one batch: the loss falls fast


# -- parameters -------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,top_k,every", [(1, 1, 1), (4, 2, 2), (8, 1, 3), (3, 3, 1)])
def test_parameter_count_matches_the_closed_form(experts, top_k, every):
    cfg = replace(TINY, moe_experts=experts, moe_top_k=top_k, moe_every=every)
    model = GPT(cfg)
    V, h, s, L = cfg.padded_vocab_size, cfg.d_model, cfg.seq_len, cfg.n_layers
    moe_blocks = len(range(0, L, every))
    mlp = 8 * h * h + 5 * h
    # Dense Ψ plus, per MoE block, E - 1 more MLPs and the router's h·E.
    dense = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h + V * h
    formula = dense + moe_blocks * ((experts - 1) * mlp + h * experts)
    assert count_parameters(model) == formula == parameter_count(cfg)
    assert part_parameter_counts(cfg) == [count_parameters(model.embed), *map(count_parameters, model.blocks),
                                          count_parameters(model.head)]
    assert active_parameter_count(cfg) == formula - moe_blocks * (experts - top_k) * mlp
    assert tp_shard_parameter_count(cfg, 1) == formula


def test_dense_only_formulas_refuse_experts():
    with pytest.raises(ValueError, match=r"tensor-parallel shard counts .*model.moe_experts=4"):
        tp_shard_parameter_count(TINY_MOE, 2)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_shard_holds_its_experts_and_everything_else(ep):
    held = set()
    for rank in range(ep):
        model = GPT(TINY_MOE, seed=0)
        # shard_experts only reads the rank and size while building; no collective runs.
        names = shard_experts(model, SimpleNamespace(rank=rank, size=ep))
        assert count_parameters(model) == ep_shard_parameter_count(TINY_MOE, ep)
        assert set(names) == {n for n, _ in model.named_parameters() if ".experts." in n}
        assert set(model.state_dict()) <= set(GPT(TINY_MOE).state_dict())  # single-process names
        held |= set(names)
    assert held == {n for n, _ in GPT(TINY_MOE).named_parameters() if ".experts." in n}


def test_presets_load_and_count():
    presets = {path.stem: yaml.safe_load(path.read_text()) for path in CONF.glob("*.yaml")}
    for name, fields in presets.items():
        # Every key of every preset (GPT-2's block, Llama's, with or without experts) is a GPTConfig field.
        unknown = set(fields) - set(GPTConfig.__dataclass_fields__)
        assert not unknown, (name, unknown)
        GPTConfig(**fields)
        # A preset with experts says so in its name: *_moe, or a published mixture's (mixtral_*).
        assert bool(set(MOE_FIELDS) & set(fields)) == (name.endswith("_moe") or name.startswith("mixtral_")), name
    # Mixtral 8x7B: "47B" parameters, "13B active" (Jiang et al. 2024); 8x22B: 141B, 39B active.
    for name, psi in (("tiny_moe", 433_920), ("small_moe", 21_206_528), ("small_llama_moe", 22_688_000),
                      ("mixtral_8x7b", 46_702_792_704), ("mixtral_8x22b", 140_620_634_112)):
        cfg = GPTConfig(**yaml.safe_load((CONF / f"{name}.yaml").read_text()))
        assert cfg.moe_experts and parameter_count(cfg) == psi
    assert count_parameters(GPT(GPTConfig(**yaml.safe_load((CONF / "tiny_moe.yaml").read_text())))) == 433_920


@pytest.mark.parametrize("fields,message", [
    ({"moe_experts": -1}, r"model.moe_experts=-1 must be a non-negative integer"),
    ({"moe_experts": 2, "moe_top_k": 3}, r"model.moe_top_k=3 is more than model.moe_experts=2"),
    ({"moe_experts": 2, "moe_every": 0}, r"model.moe_every=0 must be a positive integer"),
    ({"moe_experts": 2, "moe_capacity_factor": 0.0}, r"model.moe_capacity_factor=0.0 must be a finite number > 0"),
    ({"moe_experts": 2, "moe_aux_weight": -0.1}, r"model.moe_aux_weight=-0.1 must be a finite number >= 0"),
])
def test_bad_moe_config_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)
