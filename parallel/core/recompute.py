"""Activation recomputation: keep less for backward, run the forward again when backward needs it.

Backward needs what the forward ops saved (a linear's input, a LayerNorm's mean and rstd, the
attention's output and log-sum-exp, ...). Recomputation keeps only the *inputs* of a region, runs
the region's forward without saving anything, and, when backward reaches the region, runs its
forward again (this time saving) and backpropagates through that (Chen et al. 2016, arXiv
1604.06174; Korthikanti et al. 2022, arXiv 2205.05198, §5 "selective activation recomputation").

    train.recompute=none        nothing recomputed
    train.recompute=selective   each block's attention core (`attn.core`: the part whose memory
                                grows with s² in the unfused attention Korthikanti et al. recompute)
    train.recompute=full        each Block: only its input b·s·h is kept through the forward

It is a transform, applied after the strategy's own (tensor parallel shards, context-parallel
cores, pipeline cuts): it wraps whatever the blocks now are, so a recomputed region re-runs the
strategy's forward collectives too (under tensor parallelism `full` all-reduces each block's
outputs again: 12 instead of 8 units of b·s·h·(t−1)/t per layer; a context-parallel core sends
its K, V blocks around the ring again). The bytes saved for backward, per op, are derived in
docs/theory/memory.md.

`_Recompute` is written here rather than taken from torch.utils.checkpoint: the tensors it keeps
are saved with `save_for_backward`, and the recomputed forward runs under whatever saved-tensor
hooks are active, so parallel/report/activations.py's meter sees exactly what is held, the block
recomputed inside backward included. (torch.utils.checkpoint's non-reentrant version saves its
inputs through autograd too, but stores what it recomputes under hooks of its own: a meter on
saved-tensor hooks misses the peak in backward.)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.model import Block

MODES = ("none", "selective", "full")


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _Recompute(torch.autograd.Function):
    """y = run(*inputs), keeping only the inputs; backward runs `run` again and backpropagates through it."""

    @staticmethod
    def forward(ctx, run, phases, *inputs):
        # A Function's forward runs with gradients off: `run` saves nothing here.
        device = inputs[0].device
        ctx.run, ctx.device, ctx.phases = run, device, phases
        ctx.autocast = _autocast_state(device.type)
        # The random state, so that dropout draws the same masks the second time.
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        ctx.save_for_backward(*inputs)
        return run(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        enabled, dtype = ctx.autocast
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        if ctx.phases is not None:
            ctx.phases("recompute", "recompute")  # the time breakdown's recompute, apart from backward
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            outputs = ctx.run(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if ctx.phases is not None:
            ctx.phases("backward", "after recompute")
        # Parameters inside the region get their gradients here, accumulated as in a plain backward
        # (their post-accumulate hooks, which the gradient syncs use, fire as usual).
        torch.autograd.backward(outputs, grads)
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


def recompute(run, *inputs: torch.Tensor, phases=None):
    """`run(*inputs)` under recomputation (plainly when no gradient is being recorded). `phases`: the
    strategy's phase log (parallel/core/phases.py), told when the second forward runs."""
    if not torch.is_grad_enabled():
        return run(*inputs)
    if not any(t.requires_grad for t in inputs):
        # The Function would then have no place in the graph, and the region's parameters no gradient.
        raise ValueError("a recomputed region needs an input that requires grad")
    return _Recompute.apply(run, phases, *inputs)


class RecomputedCore(nn.Module):
    """An attention core (no parameters of its own) whose forward is recomputed in backward."""

    def __init__(self, inner: nn.Module, phases=None):
        super().__init__()
        self.inner = inner
        self.phases = phases

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return recompute(self.inner, q, k, v, phases=self.phases)


def _recompute_block(block: Block, phases=None) -> None:
    """Run this Block's own forward under recomputation. The forward is replaced on the instance,
    not the Block wrapped in a module: the module tree and every parameter name stay the same
    (checkpoints, gradient-sync tags and pipeline chunks refer to them)."""
    forward = block.forward  # the class's forward, bound to this block

    def recomputed(x: torch.Tensor) -> torch.Tensor:
        return recompute(forward, x, phases=phases)

    block.forward = recomputed


def apply_recompute(model: nn.Module, mode: str, phases=None) -> int:
    """Recompute every Block of `model` (full) or every Block's attention core (selective), in place.
    `phases`: the strategy's phase log, so that the time breakdown shows recomputation apart.
    Returns the number of regions wrapped."""
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r} is not one of {', '.join(MODES)}")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if mode == "selective":
        for block in blocks:
            block.attn.core = RecomputedCore(block.attn.core, phases)
    elif mode == "full":
        for block in blocks:
            _recompute_block(block, phases)
    return 0 if mode == "none" else len(blocks)
