"""What every strategy does in one optimizer step, and the single-process reference.

One step: for each microbatch, forward, loss, backward (gradients accumulate); then whatever
synchronisation the strategy needs; then the optimizer. The loss of every microbatch is its
summed token loss divided by the number of tokens in the *global* batch, so the gradients add up
to the gradient of the global mean loss however the batch is split. That is why the strategies
sum gradients across ranks (never average them) and why their losses match the single run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .comm import Communicator
from .data import Batch
from .model import token_loss_sum
from .optim import AdamW


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a freed
    storage, resized to 0, counts 0): what a rank really holds, not what the shapes suggest."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> AdamW:
    """AdamW; no weight decay on biases and LayerNorm weights (the nanoGPT/GPT-2 convention)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


class Strategy:
    """Base: a model, its optimizer, and the step loop with hooks for gradient synchronisation."""

    name = "single"

    def __init__(self, model: nn.Module, optimizer: AdamW, loss_comm: Communicator | None = None):
        self.model = model
        self.optimizer = optimizer
        # The group over which the per-rank loss shares add up to the global loss (None: one rank).
        self.loss_comm = loss_comm
        # The context every forward pass runs in: nothing for fp32, autocast for bf16
        # (parallel/precision.py; the training loop sets it from train.precision).
        self.forward_context = contextlib.nullcontext

    # Hooks the data-parallel strategies fill in ----------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward_context(self, last_microbatch: bool):
        """Entered around each microbatch's forward and backward."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Called once all microbatches have run backward, before the optimizer."""

    def forward_loss(self, mb: Batch, global_tokens: int) -> torch.Tensor:
        return token_loss_sum(self.model(mb.inputs), mb.targets) / global_tokens

    # The step ---------------------------------------------------------------------------------
    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        """Run one optimizer step; return this rank's share of the global mean loss (detached)."""
        self.zero_grad()
        local_loss = torch.zeros((), device=microbatches[0].inputs.device)
        for i, mb in enumerate(microbatches):
            with self.backward_context(last_microbatch=i == len(microbatches) - 1):
                with self.forward_context():
                    loss = self.forward_loss(mb, global_tokens)
                loss.backward()
            local_loss += loss.detach()
        self.after_backward()
        self.optimizer.step()
        return local_loss

    def global_loss(self, local_loss: torch.Tensor) -> float:
        """The mean loss over every token of the global batch, on rank 0 (tooling traffic)."""
        if self.loss_comm is not None and self.loss_comm.size > 1:
            self.loss_comm.all_reduce(local_loss, tag="tooling/loss")
        return float(local_loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters, named as in the single-process GPT."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def full_parameter_count(self) -> int:
        """Parameters of the whole model, however it is split across ranks."""
        return sum(p.numel() for p in self.model.parameters())

    def full_grads(self) -> dict:
        """The whole model's gradients as the optimizer sees them (after every sync), single-process
        names; `tp_replica_max_diff` is filled by strategies that replicate parameters over tp."""
        return {"grads": {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()},
                "tp_replica_max_diff": {}}

    def memory_report(self) -> dict:
        """Model-state bytes this rank holds after a step, measured from its tensors. Here every
        one of them is held for the whole step (gradients from the first backward on), so the
        peak is their sum; the ZeRO strategies track theirs as tensors come and go."""
        params = storage_bytes(self.model.parameters())
        grads = storage_bytes(p.grad for p in self.model.parameters())
        state = storage_bytes(t for s in self.optimizer.state.values() for t in s.values())
        return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state,
                "peak_model_state_bytes": params + grads + state}

    def close(self) -> None:
        """Finish outstanding communication before the process group goes away."""


class SingleProcess(Strategy):
    name = "single"
