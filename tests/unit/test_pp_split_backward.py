"""B and W (parallel/pp/split_backward.py) are the whole backward, split, in one process.

The tiny GPT cut into two pipeline chunks (the first with the embedding, the last with the head
and the loss) and into four (a middle chunk takes and gives hidden states), two microbatches each:
B then W on every chunk, with the W of the two microbatches run in the opposite order of their B
(as a zero-bubble schedule may), against the whole backward. Checked: the input gradients and every
weight gradient are bitwise equal; B leaves every .grad untouched; W accumulates each parameter
exactly once (its post-accumulate-grad hook fires once, which the bucketed dp sync and ZeRO-2 count
on); what the forward saved stays held until W and is all released after it. And a weight used
twice in a chunk (two forks into the spine): still equal. No processes, about a second.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from parallel.core.model import GPT, GPTConfig, token_loss_sum
from parallel.pp.split import split_model
from parallel.pp.split_backward import SplitBackward
from parallel.report.activations import ActivationMeter

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layers=4, d_model=32, n_heads=4)


def batch(mb: int):
    gen = torch.Generator().manual_seed(100 + mb)
    shape = (2, CFG.seq_len)
    return torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen)


def forward(chunks, mb: int) -> list:
    """One microbatch through the chunks: (input, output) per chunk, each input after the first a
    leaf, as when received from another rank; the last output is the loss."""
    idx, targets = batch(mb)
    x, graph = idx, []
    for c, chunk in enumerate(chunks):
        x_in = x if c == 0 else x.detach().requires_grad_(True)
        out = chunk(x_in)
        if c == len(chunks) - 1:
            out = token_loss_sum(out, targets) / (2 * 2 * CFG.seq_len)
        graph.append((x_in, out))
        x = out
    return graph


def backward(chunks, graph: list, split: bool, input_grads: dict, mb: int) -> list[SplitBackward]:
    """The chunks' backwards, last to first: whole, or B only (the W returned for later)."""
    grad, pending = None, []
    while graph:
        x, out = graph.pop()
        c = len(graph)
        x = x if c > 0 else None
        if split:
            pending.append(SplitBackward(out, grad, x, list(chunks[c].parameters())))
            pending[-1].input_grad()
        else:
            torch.autograd.backward(out, grad)
        del out
        if x is not None:
            grad = x.grad
            input_grads[(mb, c)] = x.grad.clone()
    return pending


def run_pipeline(stages: int, split: bool, events: dict | None = None, measure: bool = False) -> dict:
    """Two microbatches through `stages` chunks in one process; returns every gradient, the input
    gradients each chunk passed back and (`measure`) the bytes saved for backward after the
    forwards, the B's and the W's. With `split`, the B of microbatch 0 then 1, then every W,
    microbatch 1's before 0's."""
    model = GPT(CFG, seed=0)
    chunks = [split_model(model, stages, 1, r)[0] for r in range(stages)]
    meter = ActivationMeter(model.parameters()) if measure else None
    with meter.step() if measure else contextlib.nullcontext():
        return _steps(model, chunks, split, events, meter)


def _steps(model, chunks, split: bool, events: dict | None, meter: ActivationMeter | None) -> dict:
    if events is not None:
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, n=name: events.setdefault(n, []).append(events["phase"]))
    graphs = [forward(chunks, mb) for mb in range(2)]
    held = [meter.current if meter is not None else None]
    if events is not None:
        events["phase"] = "B"
    input_grads, pending = {}, []
    for mb in range(2):
        pending += backward(chunks, graphs[mb], split, input_grads, mb)
    held.append(meter.current if meter is not None else None)
    if events is not None:
        events["phase"] = "W"
    while pending:  # microbatch 1's W before microbatch 0's
        pending.pop().weight_grad()
    held.append(meter.current if meter is not None else None)
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "input_grads": input_grads,
            "held": held}


@pytest.mark.parametrize("stages", [2, 4])
def test_b_then_w_is_the_whole_backward_bitwise(stages):
    whole, split = run_pipeline(stages, split=False), run_pipeline(stages, split=True)
    assert split["input_grads"].keys() == whole["input_grads"].keys() and whole["input_grads"]
    for key, g in whole["input_grads"].items():
        assert torch.equal(split["input_grads"][key], g), key
    assert split["grads"].keys() == whole["grads"].keys()
    for name, g in whole["grads"].items():
        assert torch.equal(split["grads"][name], g), name


def test_b_accumulates_nothing_and_w_each_weight_once_per_microbatch():
    events = {"phase": "F"}
    run_pipeline(2, split=True, events=events)
    phase = events.pop("phase")
    assert phase == "W"
    model_names = {n for n, _ in GPT(CFG, seed=0).named_parameters()}
    assert events.keys() == model_names
    assert all(seen == ["W", "W"] for seen in events.values()), {n: s for n, s in events.items() if s != ["W", "W"]}


def test_activations_are_held_until_w():
    whole = run_pipeline(2, split=False, measure=True)["held"]
    after_forward, after_b, after_w = run_pipeline(2, split=True, measure=True)["held"]
    assert after_forward == whole[0] > 0 and whole[1:] == [0, 0]
    # B lets go of what only the nodes above the weights' forks saved (the loss's logits); the rest
    # is held until W, and W releases all of it (ActivationMeter sees every saved tensor go).
    assert 0 < after_b < after_forward and after_w == 0


class TwiceUsed(nn.Module):
    """One weight on two forks of the spine: y = W·(W·x + b) + b."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_a_weight_used_twice_is_not_counted_twice():
    torch.manual_seed(0)
    module, x0, g = TwiceUsed(), torch.randn(4, 8), torch.randn(4, 8)
    x = x0.clone().requires_grad_(True)
    torch.autograd.backward(module(x), g)
    want = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    step = SplitBackward(module(x), g, x, list(module.parameters()))
    step.input_grad()
    assert len(step.groups) == 1 and len(step.groups[0][0]) > 1  # one group, several forks
    step.weight_grad()
    got = [p.grad for p in module.parameters()] + [x.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
