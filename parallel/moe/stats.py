"""Where the router sent the tokens, step by step: the raw material of the summary's `moe` block.

A `RoutingMeter` puts a forward hook on every MoE MLP of a model (a whole GPT, a wrapped one, an
expert-parallel one) and records, for each call in a training step (one MoE block on one
microbatch, in the order they ran), the assignments per expert before dropping (`routed`) and
after (`kept`), of this rank's tokens. Every strategy's rank reports them; the summary adds them up
over ranks (parallel/moe/report.py) and, under expert parallelism, theory turns the kept counts
into the step's exact all-to-all bytes (parallel/moe/theory.py, ep_comm).

The counts are read with `.tolist()`; the MoE layer already reads them to the host to split its
rows by expert, so this adds no device synchronisation of its own.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from parallel.core.model import MoEMLP


def block_name(module_name: str) -> str:
    """`module.blocks.2.mlp` (under a DDP wrapper) -> `blocks.2.mlp`: the single-process name."""
    return module_name[module_name.index("blocks."):] if "blocks." in module_name else module_name


class RoutingMeter:
    def __init__(self, model: nn.Module):
        # One list of calls per step: {"block": "blocks.0.mlp", "routed": [E ints], "kept": [E ints]}.
        self.steps: list[list[dict]] = []
        self._current: list[dict] | None = None
        for name, module in model.named_modules():
            if isinstance(module, MoEMLP):
                module.register_forward_hook(self._recorder(block_name(name)))

    def _recorder(self, block: str):
        def hook(module: MoEMLP, _inputs, _output) -> None:
            if self._current is not None:  # forwards outside a training step are not counted
                self._current.append({"block": block, "routed": module.routed_counts.tolist(),
                                      "kept": module.kept_counts.tolist()})
        return hook

    @contextlib.contextmanager
    def step(self):
        """Around one training step: its calls become one entry of `steps`."""
        self._current = []
        try:
            yield
        finally:
            self.steps.append(self._current)
            self._current = None
