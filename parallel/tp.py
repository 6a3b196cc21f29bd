"""Tensor parallelism (Megatron-LM), written by hand on the communication log.

Shoeybi et al. 2019 (arXiv 1909.08053) split each transformer block into two *tensor-parallel
regions*, attention and MLP. A region starts with column-parallel linears (each rank computes its
slice of the output features: its heads, its slice of the MLP width) and ends with a
row-parallel linear (each rank multiplies its slice of the input features and the partial outputs
are summed). Two conjugate autograd functions mark the edges of a region:

    copy_to_tp       (Megatron's f)  forward: identity      backward: all-reduce
    reduce_from_tp   (Megatron's g)  forward: all-reduce    backward: identity

so per block and microbatch there are 2 all-reduces of b·s·h in forward and 2 in backward.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) also shards the residual
stream, and with it the LayerNorms, along the sequence between regions. f and g become

    gather_from_sp          forward: all-gather (seq)       backward: reduce-scatter (seq)
    reduce_scatter_to_sp    forward: reduce-scatter (seq)   backward: all-gather (seq)

the same bytes in twice the ops. Activations are (batch, seq, hidden): sequence is dim 1.

`parallelize_tp` turns the one GPT of parallel/model.py into this rank's shard in place, cutting
every shard from the full single-process initialization, so any tp degree starts from the same
numbers. It reuses the model's own Block, attention, MLP and Head code: only the linears, the
LayerNorms in front of each region (which now also open the region) and the embedding are
replaced. Parameter names are unchanged, so a gathered shard is the single-process state dict.

Every collective is tagged `tp/<part>/<fwd|bwd>` (e.g. `tp/blocks.3.attn/bwd`), so the Megatron
count per layer and direction can be read off summary.json's `comm.by_tag_op`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import Communicator
from .model import GPT

SEQ_DIM = 1  # activations are (batch, seq, hidden)


# -- collectives along any dim (the log's all-gather and reduce-scatter work on dim 0) ----------
def all_gather_along(comm: Communicator, shard: torch.Tensor, dim: int, tag: str) -> torch.Tensor:
    moved = shard.movedim(dim, 0).contiguous()
    full = torch.empty((moved.shape[0] * comm.size, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    comm.all_gather_into(full, moved, tag=tag)
    return full.movedim(0, dim).contiguous()


def reduce_scatter_along(comm: Communicator, full: torch.Tensor, dim: int, tag: str) -> torch.Tensor:
    moved = full.movedim(dim, 0).contiguous()
    shard = torch.empty((moved.shape[0] // comm.size, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    comm.reduce_scatter(shard, moved, tag=tag)
    return shard.movedim(0, dim).contiguous()


def _summed(comm: Communicator, x: torch.Tensor, tag: str) -> torch.Tensor:
    # A copy: the all-reduce works in place, and autograd's tensors must not change under it.
    out = x.contiguous().clone()
    comm.all_reduce(out, tag=tag)
    return out


# -- the four region functions ------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: the region's input is replicated; each rank's backward holds only its part of its gradient."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(ctx.comm, grad, f"{ctx.tag}/bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: partial outputs summed; the gradient of a sum is the same on every rank."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, tag: str):
        return _summed(comm, x, f"{tag}/fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromSP(torch.autograd.Function):
    """f under sequence parallelism: the whole sequence enters the region."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return all_gather_along(comm, x, SEQ_DIM, f"{tag}/fwd")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(ctx.comm, grad, SEQ_DIM, f"{ctx.tag}/bwd"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """g under sequence parallelism: sum partial outputs, keep this rank's piece of the sequence."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return reduce_scatter_along(comm, x, SEQ_DIM, f"{tag}/fwd")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(ctx.comm, grad, SEQ_DIM, f"{ctx.tag}/bwd"), None, None


def sum_sequence_partial_grads(params: list[nn.Parameter], comm: Communicator) -> None:
    """Sequence parallelism leaves each tp rank with the gradient of its piece of the sequence for
    the replicated parameters that act on sequence-sharded activations (norms, row-parallel biases,
    positions): add them up over tp, in one all-reduce of all of them flattened."""
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    comm.all_reduce(flat, tag="tp/sp_grads")
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()


def enter_region(x, comm: Communicator, tag: str, sequence_parallel: bool) -> torch.Tensor:
    return (_GatherFromSP if sequence_parallel else _CopyToTP).apply(x, comm, tag)


def exit_region(x, comm: Communicator, tag: str, sequence_parallel: bool) -> torch.Tensor:
    return (_ReduceScatterToSP if sequence_parallel else _ReduceFromTP).apply(x, comm, tag)


# -- layers -------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n].detach().clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r: rank r holds output features [r·out/t, (r+1)·out/t) of the weight and bias.

    Its input must already be in the region (replicated, or gathered under sequence
    parallelism): Q, K and V share one input, so the module in front of them (`NormIntoTP`)
    opens the region once, and backward all-reduces one input gradient, not three.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_full(cls, linear: nn.Linear, comm: Communicator) -> "ColumnParallelLinear":
        bias = _rows(linear.bias, comm.rank, comm.size) if linear.bias is not None else None
        return cls(_rows(linear.weight, comm.rank, comm.size), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    def from_full(cls, linear: nn.Linear, comm: Communicator, tag: str, sequence_parallel: bool) -> "RowParallelLinear":
        weight = _rows(linear.weight.t(), comm.rank, comm.size).t().contiguous()
        return cls(weight, linear.bias.detach().clone(), comm, tag, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_region(F.linear(x, self.weight), self.comm, self.tag, self.sequence_parallel) + self.bias


class NormIntoTP(nn.LayerNorm):
    """A LayerNorm whose output enters a tensor-parallel region (attention, MLP or the LM head).

    Under sequence parallelism the norm runs on this rank's piece of the sequence and the
    all-gather follows it, as in Korthikanti et al. Fig. 5.
    """

    def __init__(self, norm: nn.LayerNorm, comm: Communicator, tag: str, sequence_parallel: bool):
        super().__init__(norm.normalized_shape, eps=norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)
        self.weight, self.bias = norm.weight, norm.bias  # the very same parameters
        self.comm, self.tag, self.sequence_parallel = comm, tag, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return enter_region(super().forward(x), self.comm, self.tag, self.sequence_parallel)


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
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = exit_region(self.tok(idx), self.comm, "tp/embed", self.sequence_parallel)
        first = self.comm.rank * x.shape[SEQ_DIM] if self.sequence_parallel else 0
        positions = torch.arange(first, first + x.shape[SEQ_DIM], device=idx.device)
        return self.drop(x + self.pos(positions))


# -- the transform ------------------------------------------------------------------------------
@dataclass
class TPShards:
    """What `parallelize_tp` did, by parameter name.

    split_dim: sharded parameters and the dim they are cut along (gather along it to get the full
    tensor). sequence_partial: replicated parameters whose gradient each rank only partly holds
    under sequence parallelism (summed over the group after backward).
    """

    vocab_start: int
    split_dim: dict[str, int] = field(default_factory=dict)
    sequence_partial: list[str] = field(default_factory=list)


def parallelize_tp(model: GPT, comm: Communicator, sequence_parallel: bool = False) -> TPShards:
    """Turn the full model into this rank's tensor-parallel shard, in place."""
    sp = sequence_parallel
    for i, block in enumerate(model.blocks):
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        block.ln1 = NormIntoTP(block.ln1, comm, f"tp/{attn}", sp)
        for name in ("q", "k", "v"):  # heads split: rank r holds heads [r·a/t, (r+1)·a/t)
            setattr(block.attn, name, ColumnParallelLinear.from_full(getattr(block.attn, name), comm))
        block.attn.proj = RowParallelLinear.from_full(block.attn.proj, comm, f"tp/{attn}", sp)
        block.ln2 = NormIntoTP(block.ln2, comm, f"tp/{mlp}", sp)
        block.mlp.fc = ColumnParallelLinear.from_full(block.mlp.fc, comm)
        block.mlp.proj = RowParallelLinear.from_full(block.mlp.proj, comm, f"tp/{mlp}", sp)
    model.embed = ParallelEmbedding(model.embed, comm, sp)
    model.head.ln_f = NormIntoTP(model.head.ln_f, comm, "tp/head", sp)
    model.head.out = ColumnParallelLinear.from_full(model.head.out, comm)  # the vocabulary split

    shards = TPShards(vocab_start=model.embed.tok.vocab_start)
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
