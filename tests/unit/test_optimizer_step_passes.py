"""The planner's optimizer-step passes (parallel/planner/optimizer_step.py) against the update's own operations.

One parameter of N elements is stepped by parallel/core/optim.py's AdamW and SGD (after a first step, so
the moments exist) under a dispatch mode that sees each torch operation: one that touches N elements is a
pass, its bytes what its tensor arguments read and its outputs write. Their count and bytes must be the
table's; the elements a rank steps are its parameters, or ZeRO's padded 1/n of each part.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.algebra import padded
from parallel.core.optim import SGD, AdamW
from parallel.planner.codec import bytes_per_element
from parallel.planner.optimizer_step import PASSES, elements_stepped, optimizer_passes, optimizer_seconds

N = 4096


class ElementwiseCounter(TorchDispatchMode):
    """The operations over N elements: how many, and the bytes they read and write."""

    def __init__(self):
        super().__init__()
        self.count, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.namespace != "aten":
            return out
        tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.numel() == N for t in tensors):
            self.count += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if t.numel() == N)
        return out


@pytest.mark.parametrize("name, make", [("adamw", lambda ps: AdamW(ps, lr=1e-3)), ("sgd", lambda ps: SGD(ps, lr=1e-3))])
def test_the_pass_table_is_the_updates_operations(name, make):
    p = torch.nn.Parameter(torch.randn(N))
    optimizer = make([{"params": [p], "weight_decay": 0.1}])
    p.grad = torch.randn(N)
    optimizer.step()  # the moments are created at the first step
    counter = ElementwiseCounter()
    with counter:
        optimizer.step()
    assert counter.count == len(PASSES[name])
    assert counter.bytes == N * bytes_per_element(PASSES[name])


def test_bf16_is_one_fused_pass_and_the_seconds_are_bytes_over_the_rate():
    assert optimizer_passes("adamw", "fp32") == PASSES["adamw"]
    assert [bytes_per_element(optimizer_passes(name, "bf16")) for name in ("adamw", "sgd")] == [30, 14]
    assert optimizer_seconds(1000, "adamw", "fp32", 1e9) == pytest.approx(1000 * 84 / 1e9)
    assert optimizer_seconds(1000, "sgd", "fp32", None) == 0.0


def test_a_rank_steps_its_parameters_or_zeros_padded_share():
    parts = [1000, 30, 7]
    assert elements_stepped(parts, 0, 4) == 1037
    assert elements_stepped(parts, 1, 4) == sum(padded(n, 4) for n in parts) // 4
    assert elements_stepped(parts, 3, 4) == elements_stepped(parts, 2, 4) == elements_stepped(parts, 1, 4)
