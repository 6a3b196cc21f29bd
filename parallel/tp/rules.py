"""Tensor parallelism's refusals, checked by plan.py before any process group.

The cut itself (heads, the padded vocabulary and, under sequence parallelism, the sequence must
divide over tp; no dropout), which plan.py runs for every entry that says `tensor_parallel=True`,
and why tensor parallelism refuses a mixture of experts, the line the registry's model check ends
in (docs/experts.md).
"""

from __future__ import annotations

from math import gcd

from parallel.core.model import GPTConfig
from parallel.dist.dims import LayoutError, ParallelDims

TP_NO_MOE = ("tensor parallelism cuts the dense MLP's fc and proj over tp ranks (parallelize_tp) and has no cut for an "
             "MoE block's router and experts")


def check_tensor_parallel(model: GPTConfig, dims: ParallelDims, sequence_parallel: bool) -> None:
    """The model must split evenly over tp ranks.

    Heads are split whole, so n_heads % tp == 0; then d_model = n_heads·head_dim and the MLP
    width mlp_ratio·d_model divide by tp as well, and the Q/K/V, output projection, fc and
    proj shards are all whole. The padded vocabulary is split for the embedding and the head;
    the sequence, under sequence parallelism, for everything between the regions.
    """
    t = dims.tp
    if t == 1:
        return
    if model.n_heads % t:
        options = [d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0]
        listed = ", ".join(map(str, options[:-1])) + f" or {options[-1]}" if len(options) > 1 else str(options[0])
        raise LayoutError(
            f"model.n_heads={model.n_heads} is not divisible by parallel.tp={t}: "
            f"use a tp that divides the head count ({listed})"
        )
    vocab = model.padded_vocab_size
    if vocab % t:
        multiple = model.vocab_pad_multiple * t // gcd(model.vocab_pad_multiple, t)
        raise LayoutError(
            f"the padded vocabulary {vocab} (model.vocab_size={model.vocab_size} rounded up to a multiple of "
            f"model.vocab_pad_multiple={model.vocab_pad_multiple}) is not divisible by parallel.tp={t}: "
            f"pad to a multiple of tp, e.g. model.vocab_pad_multiple={multiple}"
        )
    if sequence_parallel and model.seq_len % t:
        raise LayoutError(
            f"model.seq_len={model.seq_len} is not divisible by parallel.tp={t}, and sequence parallelism cuts "
            f"each sequence into tp pieces: use a seq_len that is a multiple of {t}, or parallel=tp without it"
        )
    if model.dropout:
        raise LayoutError(
            f"model.dropout={model.dropout} with parallel.tp={t}: each tp rank would draw its own dropout mask on "
            "activations that must stay identical across the group, and the replicas would drift apart: "
            "set model.dropout=0"
        )
