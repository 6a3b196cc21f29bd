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

What the column-parallel linears behind gather_from_sp keep for their weight gradient
(parallel.tp_saves): the all-gathered input, b·s·h per region ("gathered"), or this rank's piece of
it, b·(s/t)·h, all-gathered once more in backward when the first of the region's linears needs it
("sharded": Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication under sequence_parallel).
The second all-gather is tagged `tp/<part>/regather`; `linear_on_sequence_piece` below.

Every collective is tagged `tp/<part>/<fwd|bwd>` (e.g. `tp/blocks.3.attn/bwd`), so the Megatron
count per layer and direction can be read off summary.json's `comm.by_tag_op`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.dist.comm import Communicator

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


def sum_sequence_partial_grads(grads: list[torch.Tensor], comm: Communicator) -> None:
    """Sequence parallelism leaves each tp rank with the gradient of its piece of the sequence for
    the replicated parameters that act on sequence-sharded activations (norms, row-parallel biases,
    positions): add them up over tp, in place, in one all-reduce of all of them flattened."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, tag="tp/sp_grads")
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_kv_replica_grads(grads: list[torch.Tensor], replicas: int, comm: Communicator) -> None:
    """K and V where tp exceeds the kv heads: each kv head's projection is held by r = t/kv consecutive
    tp ranks (`replicas`), and each of them computed its weight gradient from its own query heads
    only. Sum them over those r ranks, in place: one all-reduce over tp of a buffer with one slot per
    kv head, this rank's gradients written into its head's slot and zeros elsewhere (`tp/kv_grads`)."""
    if not grads:
        return
    mine = torch.cat([g.reshape(-1) for g in grads])
    slots = torch.zeros(comm.size // replicas, mine.numel(), dtype=mine.dtype, device=mine.device)
    slots[comm.rank // replicas] = mine
    comm.all_reduce(slots, tag="tp/kv_grads")
    offset, summed = 0, slots[comm.rank // replicas]
    for g in grads:
        g.copy_(summed[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def enter_region(x, comm: Communicator, tag: str, sequence_parallel: bool) -> torch.Tensor:
    return (_GatherFromSP if sequence_parallel else _CopyToTP).apply(x, comm, tag)


def exit_region(x, comm: Communicator, tag: str, sequence_parallel: bool) -> torch.Tensor:
    return (_ReduceScatterToSP if sequence_parallel else _ReduceFromTP).apply(x, comm, tag)


# -- sharded saving: the column-parallel linears keep the sequence piece ----------------------------
class SequencePiece:
    """A region's input as this rank's piece of the sequence, and its all-gather again in backward.

    Made by the norm that opens the region (one per forward), handed to each column-parallel linear
    that reads the gathered input (Q, K and V share one). In backward the first of them gathers
    the piece (`tp/<part>/regather`), the others reuse that one tensor, and the last lets it go: one
    all-gather per region, held only while its weight gradients are computed."""

    def __init__(self, piece: torch.Tensor, comm: Communicator, tag: str):
        self.piece, self.comm, self.tag = piece, comm, tag
        self.readers = 0  # linears whose backward still needs the gathered input
        self.gathered: torch.Tensor | None = None

    def take(self, piece: torch.Tensor) -> torch.Tensor:
        if self.gathered is None:
            self.gathered = all_gather_along(self.comm, piece, SEQ_DIM, f"{self.tag}/regather")
        full, self.readers = self.gathered, self.readers - 1
        if self.readers == 0:  # nothing of this forward is held here any more
            self.gathered = self.piece = None
        return full


class _LinearOnSequencePiece(torch.autograd.Function):
    """Y = X W^T + b on the gathered X, saving the piece X_r (and W), not X.

    The input gradient flows back through X (into gather_from_sp's reduce-scatter, as before);
    the weight gradient needs X again: Y's gradient times the piece all-gathered once more.

    Each half is formed only when this backward's walk goes on to what it feeds (`_feeds`): a
    whole backward forms both; a zero-bubble schedule's B (parallel/pp/split_backward.py) only the
    input's, and its W only the weight's, where the piece is gathered: once per region either way."""

    @staticmethod
    def forward(ctx, full, piece, weight, bias, source: SequencePiece):
        ctx.source, ctx.has_bias = source, bias is not None
        ctx.save_for_backward(piece, weight)
        source.readers += 1
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        piece, weight = ctx.saved_tensors
        edges = ctx.next_functions
        grad_input = grad.matmul(weight.to(grad.dtype)) if _feeds(edges[0]) else None
        grad_weight = grad_bias = None
        if _feeds(edges[2]):
            full = ctx.source.take(piece)
            rows = grad.reshape(-1, grad.shape[-1])
            grad_weight = rows.t().matmul(full.reshape(-1, full.shape[-1]).to(grad.dtype))
            grad_bias = rows.sum(0) if ctx.has_bias else None
        return grad_input, None, grad_weight, grad_bias, None


def _feeds(edge) -> bool:
    """Whether the running backward goes on through this input's edge (autograd's own answer; it
    cannot be asked of a leaf, so the weights come in as views, whose nodes are not)."""
    node = edge[0]
    return node is not None and torch._C._will_engine_execute_node(node)


def linear_on_sequence_piece(full: torch.Tensor, source: SequencePiece, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
    bias = bias.view_as(bias) if bias is not None else None
    return _LinearOnSequencePiece.apply(full, source.piece, weight.view_as(weight), bias, source)


# -- layers -------------------------------------------------------------------------------------
