"""Tensor parallelism's refusals, checked by the run validator before any process group.

Sequence parallelism only where tp cuts; the cut itself (heads, the padded vocabulary and, under
sequence parallelism, the sequence must divide over tp; no dropout), for every entry tp cuts;
what `parallel.tp_saves` may say (the sequence piece saved only where there is one); and why tensor
parallelism refuses a mixture of experts, the line the registry's model check ends in (docs/experts.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

from parallel.core.model import GPTConfig
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.family import Check
from parallel.spec import ConfigError, StrategySpec
from parallel.tp.options import TPOptions

TP_NO_MOE = ("tensor parallelism cuts the dense MLP's fc and proj over tp ranks (parallelize_tp) and has no cut for an "
             "MoE block's router and experts")


def tp_cut_refusal(model: GPTConfig, t: int, sequence_parallel: bool) -> str | None:
    """Why the model does not split evenly over t tp ranks, or None where it does.

    Heads are split whole, so n_heads % tp == 0, and d_model = n_heads·head_dim divides by tp. K/V
    heads are split whole where tp divides them, or each held whole by tp/kv ranks where tp is a
    multiple of them (`kv_heads_cut_refusal`). The MLP width (each of gate and up in a gated MLP)
    must divide by tp too, so the fc, gate and proj shards are whole. The padded vocabulary is split
    for the embedding and the head; the sequence, under sequence parallelism, for everything between
    the regions. (A predicate of its own, apart from the raise, so that the planner's search can
    leave out the tp sizes it refuses before it builds a request for them.)
    """
    if t == 1:
        return None
    if model.n_heads % t:
        options = [d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0]
        listed = ", ".join(map(str, options[:-1])) + f" or {options[-1]}" if len(options) > 1 else str(options[0])
        return (f"model.n_heads={model.n_heads} is not divisible by parallel.tp={t}: "
                f"use a tp that divides the head count ({listed})")
    why = kv_heads_cut_refusal(model, t) or mlp_cut_refusal(model, t)
    if why:
        return why
    vocab = model.padded_vocab_size
    if vocab % t:
        multiple = model.vocab_pad_multiple * t // gcd(model.vocab_pad_multiple, t)
        return (f"the padded vocabulary {vocab} (model.vocab_size={model.vocab_size} rounded up to a multiple of "
                f"model.vocab_pad_multiple={model.vocab_pad_multiple}) is not divisible by parallel.tp={t}: "
                f"pad to a multiple of tp, e.g. model.vocab_pad_multiple={multiple}")
    if sequence_parallel and model.seq_len % t:
        return (f"model.seq_len={model.seq_len} is not divisible by parallel.tp={t}, and sequence parallelism cuts "
                f"each sequence into tp pieces: use a seq_len that is a multiple of {t}, or parallel=tp without it")
    if model.dropout:
        return (f"model.dropout={model.dropout} with parallel.tp={t}: each tp rank would draw its own dropout mask on "
                "activations that must stay identical across the group, and the replicas would drift apart: "
                "set model.dropout=0")
    return None


def kv_heads_cut_refusal(model: GPTConfig, t: int) -> str | None:
    """K and V are split by whole kv heads where t divides them; where t is a multiple of them each
    rank holds the one kv head its query heads read, replicated on t/kv ranks. Anything else would
    cut a head in two."""
    kv = model.kv_heads
    if kv % t == 0 or t % kv == 0:
        return None
    heads = model.n_heads
    options = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    return (f"parallel.tp={t} neither divides nor is a multiple of model.n_kv_heads={kv}: each tp rank holds whole "
            f"K/V heads (kv/tp of them, or one shared by tp/kv ranks): use parallel.tp in "
            f"{', '.join(map(str, options))}, or a model.n_kv_heads that tp divides or is a multiple of")


def mlp_cut_refusal(model: GPTConfig, t: int) -> str | None:
    """The MLP's hidden width f (fc, and gate in a gated MLP) is split in t equal column slices. Only
    a width of its own (ffn_hidden) can fail: mlp_ratio·d_model divides by tp once the heads do."""
    if model.d_ff % t == 0:
        return None
    return (f"model.ffn_hidden={model.d_ff} is not divisible by parallel.tp={t}: each tp rank holds an equal slice "
            f"of the MLP's hidden width; use a parallel.tp that divides {model.d_ff}, or set model.ffn_hidden to a "
            f"multiple of {t}")


def check_tensor_parallel(model: GPTConfig, dims: ParallelDims, sequence_parallel: bool) -> None:
    """The model must split evenly over tp ranks (`tp_cut_refusal` says why not)."""
    why = tp_cut_refusal(model, dims.tp, sequence_parallel)
    if why:
        raise LayoutError(why)


def tp_rules(check: Check) -> None:
    """Sequence parallelism only where tp cuts, the cut itself for every entry tp cuts, then what
    `parallel.tp_saves` may say."""
    options, dims, spec = check.layout.of(TPOptions), check.dims, check.spec
    if options.sequence_parallel and (not spec.honours_option(TPOptions, "sequence_parallel") or dims.tp == 1):
        raise ConfigError(
            f"parallel.sequence_parallel=true needs tensor parallelism, "
            f"but parallel={spec.name} with parallel.tp={dims.tp}: "
            "use parallel=tp_sp (with parallel.tp > 1) or set parallel.sequence_parallel=false"
        )
    if spec.uses(TPOptions):
        check_tensor_parallel(check.model, dims, options.sequence_parallel)
    keepers = [name for name, entry in check.entries.items() if entry.honours_option(TPOptions, "saves")]
    check_tp_saves(options, spec, keepers, dims)


def check_tp_saves(options: TPOptions, spec: StrategySpec, keepers: Sequence[str], dims: ParallelDims) -> None:
    """`sharded` keeps each column-parallel input's sequence piece, which exists only under sequence
    parallelism with tp > 1, with this project's tp layers (an entry that honours tp's `saves`;
    `keepers`: the registry's names of those, for the message). With context parallelism the piece is
    of the rank's s/cp tokens; under a split backward (zero-bubble schedules) the piece is gathered in W."""
    if options.saves != "sharded":
        return
    sequence_parallel = options.sequence_parallel
    if not sequence_parallel or dims.tp == 1:
        raise LayoutError(
            f"parallel.tp_saves=sharded with parallel.tp={dims.tp} and sequence parallelism "
            f"{'on' if sequence_parallel else 'off'}: the column-parallel linears keep their input's piece of "
            "the sequence, which only sequence parallelism over tp > 1 ranks cuts; use parallel=tp_sp with "
            "parallel.tp > 1, or set parallel.tp_saves=gathered"
        )
    if not spec.honours_option(TPOptions, "saves"):
        raise LayoutError(
            f"parallel.tp_saves=sharded runs as parallel={spec.name}, whose layers keep the gathered input: "
            f"the sequence piece is kept by parallel={' and '.join(keepers)} only; "
            "set parallel.tp_saves=gathered"
        )
