"""Tensor-parallel layers and the transform that shards the one GPT in place.

`parallelize_tp` turns the one GPT of parallel/core/model.py into this rank's shard in place, cutting
every shard from the full single-process initialization, so any tp degree starts from the same
numbers. It reuses the model's own Block, attention, MLP and Head code: only the linears, the
LayerNorms in front of each region (which now also open the region) and the embedding are
replaced. Parameter names are unchanged, so a gathered shard is the single-process state dict.

The regions they open and close are in parallel/tp/regions.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.core.model import GPT
from parallel.core.norm import rms_norm
from parallel.core.shape import ModelShape
from parallel.dist.comm import Communicator
from parallel.tp.options import TPOptions
from parallel.tp.regions import SequencePiece, enter_region, exit_region, linear_on_sequence_piece
from parallel.tp.shards import TPShards


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n].detach().clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r: rank r holds output features [r·out/t, (r+1)·out/t) of the weight and bias.

    Its input must already be in the region (replicated, or gathered under sequence
    parallelism): Q, K and V share one input, so the module in front of them (`NormIntoTP`)
    opens the region once, and backward all-reduces one input gradient, not three. Where that
    norm saves the sequence piece (parallel.tp_saves=sharded), the gathered input carries it
    (`SEQUENCE_PIECE`) and the linear keeps the piece for its weight gradient, not the input.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_full(cls, linear: nn.Linear, comm: Communicator, replicas: int = 1) -> ColumnParallelLinear:
        """Piece rank // replicas of t / replicas: each piece on `replicas` consecutive ranks (K and V
        where tp exceeds the kv heads), or one piece per rank."""
        piece, pieces = comm.rank // replicas, comm.size // replicas
        bias = _rows(linear.bias, piece, pieces) if linear.bias is not None else None
        return cls(_rows(linear.weight, piece, pieces), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source = getattr(x, SEQUENCE_PIECE, None)
        if source is not None:
            return linear_on_sequence_piece(x, source, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: rank r holds input features [r·in/t, (r+1)·in/t) of the weight.

    The partial products leave the region summed (all-reduce, or reduce-scatter along the
    sequence); the full bias, where the model has one, is added once, after the sum, not t times.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator, tag: str,
                 sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.comm, self.tag, self.sequence_parallel = comm, tag, sequence_parallel

    @classmethod
    def from_full(cls, linear: nn.Linear, comm: Communicator, tag: str, sequence_parallel: bool) -> RowParallelLinear:
        weight = _rows(linear.weight.t(), comm.rank, comm.size).t().contiguous()
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight, bias, comm, tag, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = exit_region(F.linear(x, self.weight), self.comm, self.tag, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y


# The attribute of a region's gathered input that holds its sequence piece (parallel.tp_saves=sharded):
# the one tensor the norm returns is the one the region's column-parallel linears receive.
SEQUENCE_PIECE = "sequence_piece"


class NormIntoTP(nn.Module):
    """The norm (LayerNorm or RMSNorm) whose output enters a tensor-parallel region (attention, MLP or
    the LM head), with the very same parameters (an RMSNorm has no bias).

    Under sequence parallelism the norm runs on this rank's piece of the sequence and the
    all-gather follows it, as in Korthikanti et al. Fig. 5. With `saves_shard` the gathered
    output carries the piece, for the region's column-parallel linears to save instead.
    """

    def __init__(self, norm: nn.LayerNorm | nn.RMSNorm, comm: Communicator, tag: str, sequence_parallel: bool,
                 saves_shard: bool = False):
        super().__init__()
        self.normalized_shape, self.eps, self.rms = norm.normalized_shape, norm.eps, isinstance(norm, nn.RMSNorm)
        self.weight, self.bias = norm.weight, getattr(norm, "bias", None)  # the very same parameters
        self.comm, self.tag, self.sequence_parallel = comm, tag, sequence_parallel
        self.saves_shard = saves_shard and sequence_parallel

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """What the norm module computes, by the same functional call (and so saves the same tensors:
        parallel/core/norm.py's for an RMSNorm)."""
        if self.rms:
            return rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        piece = self.normalize(x)
        full = enter_region(piece, self.comm, self.tag, self.sequence_parallel)
        if self.saves_shard:
            setattr(full, SEQUENCE_PIECE, SequencePiece(piece, self.comm, self.tag))
        return full


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r·V/t, (r+1)·V/t) of the (padded) token table.

    A token outside this rank's rows looks up zeros; summing over the group gives every token its
    row. The sum is left to the caller (all-reduce, or reduce-scatter under sequence parallelism).
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start = vocab_start

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return rows.masked_fill(outside.unsqueeze(-1), 0.0)


class ParallelEmbedding(nn.Module):
    """Vocab-parallel tokens plus replicated positions (where the model has a table); replaces the
    model's `embed` (same names).

    Without sequence parallelism the partial token embeddings are all-reduced (`tp/embed/fwd`)
    and every position added. With it they are reduce-scattered to this rank's piece of the
    sequence and only that piece's positions added: the position table's gradient is then
    partial (rows of other pieces are zero here) and is summed over the group once per step
    with the other sequence-sharded gradients (`TensorParallel.after_backward`).
    """

    def __init__(self, embed: nn.Module, comm: Communicator, sequence_parallel: bool):
        super().__init__()
        vocab = embed.tok.weight.shape[0]
        self.tok = VocabParallelEmbedding(_rows(embed.tok.weight, comm.rank, comm.size), comm.rank * vocab // comm.size)
        self.pos = embed.pos
        self.drop = embed.drop
        self.positions = embed.positions  # the tokens' global positions (parallel/core/model.py `Embedding`)
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = exit_region(self.tok(idx), self.comm, "tp/embed", self.sequence_parallel)
        if self.pos is None:  # rotary positions: the attention applies them, to the whole sequence
            return self.drop(x)
        positions = self.positions(idx.shape[1], idx.device)
        if self.sequence_parallel:  # this tp rank's piece of the sequence, in a storage of its own, so that
            # what backward keeps is the piece's s/t positions, not the whole sequence's
            positions = positions.chunk(self.comm.size)[self.comm.rank].clone()
        return self.drop(x + self.pos(positions))


# -- the transform ------------------------------------------------------------------------------
def _cut_block(block: nn.Module, i: int, comm: Communicator, sp: bool, keep: bool, replicas: int) -> None:
    """One block's two regions: the norm opens each, column-parallel linears (rank r holds query heads
    [r·a/t, (r+1)·a/t), their K/V heads, its slice of the MLP width) and a row-parallel one close it."""
    attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
    block.ln1 = NormIntoTP(block.ln1, comm, f"tp/{attn}", sp, keep)
    block.attn.q = ColumnParallelLinear.from_full(block.attn.q, comm)
    block.attn.k = ColumnParallelLinear.from_full(block.attn.k, comm, replicas)
    block.attn.v = ColumnParallelLinear.from_full(block.attn.v, comm, replicas)
    block.attn.proj = RowParallelLinear.from_full(block.attn.proj, comm, f"tp/{attn}", sp)
    block.ln2 = NormIntoTP(block.ln2, comm, f"tp/{mlp}", sp, keep)
    block.mlp.fc = ColumnParallelLinear.from_full(block.mlp.fc, comm)
    if block.mlp.gate is not None:  # SwiGLU: gate and up cut alike, so silu(gate)·up is elementwise per rank
        block.mlp.gate = ColumnParallelLinear.from_full(block.mlp.gate, comm)
    block.mlp.proj = RowParallelLinear.from_full(block.mlp.proj, comm, f"tp/{mlp}", sp)


def parallelize_tp(model: GPT, comm: Communicator, options: TPOptions = TPOptions()) -> TPShards:
    """Turn the full model into this rank's tensor-parallel shard, in place, as tp's options say: under
    sequence parallelism, with parallel.tp_saves=sharded, the column-parallel linears keep their
    input's sequence piece and gather it again in backward."""
    sp = options.sequence_parallel
    keep = sp and options.saves == "sharded"
    replicas = ModelShape(model.config).kv_replicas(comm.size)  # ranks that hold each K/V head
    for i, block in enumerate(model.blocks):
        _cut_block(block, i, comm, sp, keep, replicas)
    model.embed = ParallelEmbedding(model.embed, comm, sp)
    model.head.ln_f = NormIntoTP(model.head.ln_f, comm, "tp/head", sp, keep)
    model.head.out = ColumnParallelLinear.from_full(model.head.out, comm)  # the vocabulary split
    if model.config.tied_head:  # one parameter again: the same rows of the same padded vocabulary
        model.head.out.weight = model.embed.tok.weight

    shards = TPShards(comm, vocab_start=model.embed.tok.vocab_start)
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            shards.split_dim[f"{name}.weight"] = 0
            if getattr(module, "bias", None) is not None:
                shards.split_dim[f"{name}.bias"] = 0
            if replicas > 1 and name.endswith((".attn.k", ".attn.v")):
                shared = (f"{name}.weight", f"{name}.bias")
                shards.replicas.update({p: replicas for p in shared if p in shards.split_dim})
        elif isinstance(module, RowParallelLinear):
            shards.split_dim[f"{name}.weight"] = 1
            if sp and module.bias is not None:
                shards.sequence_partial.append(f"{name}.bias")  # added to a piece of the sequence
        elif isinstance(module, NormIntoTP) and sp:
            shards.sequence_partial += [f"{name}.{p}" for p in ("weight", "bias") if getattr(module, p) is not None]
    if sp and model.embed.pos is not None:
        shards.sequence_partial.append("embed.pos.weight")
    return shards
