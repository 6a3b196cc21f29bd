"""Tensor-parallel layers and the transform that shards the one GPT in place.

`parallelize_tp` turns the one GPT of parallel/core/model.py into this rank's shard in place, cutting
every shard from the full single-process initialization, so any tp degree starts from the same
numbers. It reuses the model's own Block, attention, MLP and Head code: only the linears, the
LayerNorms in front of each region (which now also open the region) and the embedding are
replaced. Parameter names are unchanged, so a gathered shard is the single-process state dict.

The regions they open and close are in parallel/tp/regions.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.core.model import GPT
from parallel.dist.comm import Communicator
from parallel.tp.options import TPOptions
from parallel.tp.regions import SequencePiece, all_gather_along, enter_region, exit_region, linear_on_sequence_piece


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
    def from_full(cls, linear: nn.Linear, comm: Communicator) -> ColumnParallelLinear:
        bias = _rows(linear.bias, comm.rank, comm.size) if linear.bias is not None else None
        return cls(_rows(linear.weight, comm.rank, comm.size), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source = getattr(x, SEQUENCE_PIECE, None)
        if source is not None:
            return linear_on_sequence_piece(x, source, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: rank r holds input features [r·in/t, (r+1)·in/t) of the weight.

    The partial products leave the region summed (all-reduce, or reduce-scatter along the
    sequence); the full bias is added once, after the sum, not t times.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, comm: Communicator, tag: str, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias)
        self.comm, self.tag, self.sequence_parallel = comm, tag, sequence_parallel

    @classmethod
    def from_full(cls, linear: nn.Linear, comm: Communicator, tag: str, sequence_parallel: bool) -> RowParallelLinear:
        weight = _rows(linear.weight.t(), comm.rank, comm.size).t().contiguous()
        return cls(weight, linear.bias.detach().clone(), comm, tag, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_region(F.linear(x, self.weight), self.comm, self.tag, self.sequence_parallel) + self.bias


# The attribute of a region's gathered input that holds its sequence piece (parallel.tp_saves=sharded):
# the one tensor the norm returns is the one the region's column-parallel linears receive.
SEQUENCE_PIECE = "sequence_piece"


class NormIntoTP(nn.LayerNorm):
    """A LayerNorm whose output enters a tensor-parallel region (attention, MLP or the LM head).

    Under sequence parallelism the norm runs on this rank's piece of the sequence and the
    all-gather follows it, as in Korthikanti et al. Fig. 5. With `saves_shard` the gathered
    output carries the piece, for the region's column-parallel linears to save instead.
    """

    def __init__(self, norm: nn.LayerNorm, comm: Communicator, tag: str, sequence_parallel: bool,
                 saves_shard: bool = False):
        super().__init__(norm.normalized_shape, eps=norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)
        self.weight, self.bias = norm.weight, norm.bias  # the very same parameters
        self.comm, self.tag, self.sequence_parallel = comm, tag, sequence_parallel
        self.saves_shard = saves_shard and sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        piece = super().forward(x)
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
    """Vocab-parallel tokens plus replicated positions; replaces the model's `embed` (same names).

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
        positions = self.positions(idx.shape[1], idx.device)
        if self.sequence_parallel:  # this tp rank's piece of the sequence, in a storage of its own, so that
            # what backward keeps is the piece's s/t positions, not the whole sequence's
            positions = positions.chunk(self.comm.size)[self.comm.rank].clone()
        return self.drop(x + self.pos(positions))


# -- the transform ------------------------------------------------------------------------------
GATHER_TAG = "tooling/gather_params"


@dataclass
class TPShards:
    """What `parallelize_tp` did, by parameter name, and how to go between pieces and wholes.

    split_dim: sharded parameters and the dim they are cut along (gather along it to get the full
    tensor). sequence_partial: replicated parameters whose gradient each rank only partly holds
    under sequence parallelism (summed over the group after backward). With no tp group (`comm`
    None) nothing is split and every method is the identity, so a strategy that may or may not
    be tensor parallel (a pipeline stage) uses one code path.
    """

    comm: Communicator | None = None
    vocab_start: int = 0
    split_dim: dict[str, int] = field(default_factory=dict)
    sequence_partial: list[str] = field(default_factory=list)

    @property
    def rank_and_size(self) -> tuple[int, int]:
        return (self.comm.rank, self.comm.size) if self.comm is not None else (0, 1)

    def gather(self, tensors: dict[str, torch.Tensor], param_of=lambda key: key) -> dict[str, torch.Tensor]:
        """key -> this rank's piece, to key -> the full tensor on the CPU (collective over tp);
        `param_of(key)`: the parameter whose cut the tensor shares (the key itself, or for an Adam
        moment `name/exp_avg` -> `name`)."""
        out = {}
        for key, t in tensors.items():
            dim = self.split_dim.get(param_of(key))
            if dim is not None and self.comm is not None:
                t = all_gather_along(self.comm, t.detach(), dim, GATHER_TAG)
            out[key] = t.detach().cpu().clone()
        return out

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor: equal consecutive pieces along the split dim."""
        dim = self.split_dim.get(name)
        rank, size = self.rank_and_size
        if dim is None or size == 1:
            return full
        n = full.shape[dim] // size
        return full.narrow(dim, rank * n, n)

    def full_numel(self, name: str, piece: torch.Tensor) -> int:
        return piece.numel() * (self.rank_and_size[1] if name in self.split_dim else 1)

    def replica_spread(self, grads: dict[str, torch.Tensor]) -> dict[str, float]:
        """For each replicated parameter, the largest difference of its gradient across tp ranks
        (collective): zero, or the replicas would drift apart."""
        spread = {}
        if self.comm is None:
            return spread
        for name, g in grads.items():
            if name not in self.split_dim:
                copies = all_gather_along(self.comm, g.detach().unsqueeze(0), 0, GATHER_TAG)
                spread[name] = float((copies - copies[0]).abs().max())
        return spread


def parallelize_tp(model: GPT, comm: Communicator, options: TPOptions = TPOptions()) -> TPShards:
    """Turn the full model into this rank's tensor-parallel shard, in place, as tp's options say: under
    sequence parallelism, with parallel.tp_saves=sharded, the column-parallel linears keep their
    input's sequence piece and gather it again in backward."""
    sp = options.sequence_parallel
    keep = sp and options.saves == "sharded"
    for i, block in enumerate(model.blocks):
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        block.ln1 = NormIntoTP(block.ln1, comm, f"tp/{attn}", sp, keep)
        for name in ("q", "k", "v"):  # heads split: rank r holds heads [r·a/t, (r+1)·a/t)
            setattr(block.attn, name, ColumnParallelLinear.from_full(getattr(block.attn, name), comm))
        block.attn.proj = RowParallelLinear.from_full(block.attn.proj, comm, f"tp/{attn}", sp)
        block.ln2 = NormIntoTP(block.ln2, comm, f"tp/{mlp}", sp, keep)
        block.mlp.fc = ColumnParallelLinear.from_full(block.mlp.fc, comm)
        block.mlp.proj = RowParallelLinear.from_full(block.mlp.proj, comm, f"tp/{mlp}", sp)
    model.embed = ParallelEmbedding(model.embed, comm, sp)
    model.head.ln_f = NormIntoTP(model.head.ln_f, comm, "tp/head", sp, keep)
    model.head.out = ColumnParallelLinear.from_full(model.head.out, comm)  # the vocabulary split

    shards = TPShards(comm, vocab_start=model.embed.tok.vocab_start)
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            shards.split_dim[f"{name}.weight"] = 0
            if getattr(module, "bias", None) is not None:
                shards.split_dim[f"{name}.bias"] = 0
        elif isinstance(module, RowParallelLinear):
            shards.split_dim[f"{name}.weight"] = 1
            if sp:
                shards.sequence_partial.append(f"{name}.bias")  # added to a piece of the sequence
        elif isinstance(module, nn.LayerNorm) and sp:
            shards.sequence_partial += [f"{name}.weight", f"{name}.bias"]
    if sp:
        shards.sequence_partial.append("embed.pos.weight")
    return shards
