"""Expert parallelism: each MoE block's experts sharded over the ep ranks, tokens carried to them and
back by all-to-alls (GShard, Lepikhin et al. 2020, arXiv 2006.16668; Switch Transformer, Fedus et al.
2021, arXiv 2101.03961; Megatron-Core's all-to-all token dispatcher).

Rank r of an ep group of n ranks holds experts [r·E/n, (r+1)·E/n) of every MoE block, and its
own tokens (its slice of the batch). The router is replicated: every rank routes its own
sequences, as the single-process model would (routing is per sequence, parallel/core/routing.py),
so the kept assignments are the same ones. Per MoE block and microbatch, forward:

  counts    all-to-all of the E per-expert counts of this rank's kept assignments: rank j learns,
            from every source, how many rows it will get for each of its E/n experts. This is
            strategy traffic, not tooling: the algorithm cannot run without it (the receivers
            size their buffers and group the rows by expert with it), and it would be there
            with the log switched off. E int64 in, (n-1)·E/n·8 bytes sent per rank.
  dispatch  all-to-all of the routed rows (one hidden vector per kept assignment), split by the
            rank that holds the assignment's expert: the split sizes the router produced.
  experts   each local expert on its rows from every source, in source order (the order the
            single-process layer sees them in, when ranks hold consecutive slices of the batch).
  combine   all-to-all of the expert outputs back to the rows' sources, the splits reversed.

Backward runs the same two all-to-alls in reverse (autograd through `_AllToAll`): the gradient of
the combine's output goes to the experts (combine/bwd, the dispatch's splits), and the gradient of
the experts' inputs goes back to the sources (dispatch/bwd, the combine's splits). The counts are
not exchanged again. An expert's weight gradient is complete on its one rank after backward: it
has seen every token routed to it.

Tags: `ep/<block>/counts`, `ep/<block>/dispatch/fwd|bwd`, `ep/<block>/combine/fwd|bwd`, with
<block> as in the parameter names (`blocks.2.mlp`). parallel/moe/theory.py gives the exact bytes
of each from the routing counts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.model import GPT, MoEMLP
from parallel.dist.comm import Communicator


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks by split sizes; backward sends the gradient rows back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Communicator, tag: str, output_splits: list[int],
                input_splits: list[int]):
        ctx.comm, ctx.tag, ctx.splits = comm, tag, (output_splits, input_splits)
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        comm.all_to_all_single(out, rows.contiguous(), f"{tag}/fwd", output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_rows = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_single(grad_rows, grad.contiguous(), f"{ctx.tag}/bwd", input_splits, output_splits)
        return grad_rows, None, None, None, None


def expert_parallel_apply(rows: torch.Tensor, counts: torch.Tensor, local_experts: list[nn.Module],
                          comm: Communicator, tag: str) -> torch.Tensor:
    """The experts' outputs for this rank's `rows`, computed on the ranks that hold the experts.

    rows: (A, h) this rank's kept assignments sorted by expert, counts[e] of them for expert e
    (so the rows for rank j's experts are one contiguous run). Returns (A, h) in the same order.
    """
    n, per = comm.size, len(local_experts)
    received_counts = torch.empty_like(counts)
    comm.all_to_all_single(received_counts, counts.contiguous(), f"{tag}/counts")
    by_source = received_counts.view(n, per).tolist()      # [source rank][local expert]
    send_splits = counts.view(n, per).sum(dim=1).tolist()  # rows to each rank
    recv_splits = [sum(row) for row in by_source]          # rows from each rank

    received = _AllToAll.apply(rows, comm, f"{tag}/dispatch", recv_splits, send_splits)
    pieces = received.split([c for row in by_source for c in row])  # source-major, then local expert
    outputs: list[torch.Tensor | None] = [None] * len(pieces)
    for j, expert in enumerate(local_experts):
        mine = [source * per + j for source in range(n)]
        out = expert(torch.cat([pieces[i] for i in mine]))
        for i, piece in zip(mine, out.split([by_source[source][j] for source in range(n)])):
            outputs[i] = piece
    # Under bf16 autocast an expert's output is bf16 while the residual stream, and so the dispatched
    # rows, is fp32: the outputs travel in the rows' dtype (an exact cast), so that every all-to-all
    # of the layer moves rows of one dtype (the byte count's B), and are cast back on arrival, so
    # that the combine sees what the single-process layer's does.
    expert_dtype = outputs[0].dtype
    back = _AllToAll.apply(torch.cat(outputs).to(rows.dtype), comm, f"{tag}/combine", send_splits, recv_splits)
    return back.to(expert_dtype)


def local_expert_range(experts: int, ep: int, ep_rank: int) -> range:
    """The experts rank `ep_rank` of `ep` holds: [r·E/ep, (r+1)·E/ep)."""
    return range(ep_rank * experts // ep, (ep_rank + 1) * experts // ep)


class ExpertParallelMoE(MoEMLP):
    """An MoE MLP holding this rank's E/n experts; routing and combining are MoEMLP's own.

    Built from the full layer (every rank builds the full model from one seed, then keeps its
    experts), so any ep degree starts from the single-process numbers. The experts sit in a
    ModuleDict keyed by their global index: parameter names stay the single-process ones.
    """

    def __init__(self, full: MoEMLP, comm: Communicator, tag: str):
        nn.Module.__init__(self)  # not MoEMLP.__init__: it would build all E experts again
        experts = full.config.moe_experts
        if experts % comm.size:
            raise ValueError(
                f"model.moe_experts={experts} does not divide over {comm.size} expert-parallel ranks: "
                f"use an ep size that divides {experts}, or a multiple of {comm.size} experts"
            )
        self.config = full.config
        self.router = full.router
        local = local_expert_range(experts, comm.size, comm.rank)
        self.experts = nn.ModuleDict({str(e): full.experts[e] for e in local})
        self.comm, self.tag = comm, tag
        self.aux_loss_sum = self.routed_counts = self.kept_counts = None

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return expert_parallel_apply(rows, counts, list(self.experts.values()), self.comm, self.tag)


def shard_experts(model: GPT, comm: Communicator) -> list[str]:
    """Keep only this rank's experts in every MoE block of `model`, in place; the rest of the model
    stays whole. Returns the names of the expert parameters this rank now holds (their gradients
    are complete here after backward: not to be summed over the ep group, unlike the rest)."""
    names = []
    for i, block in enumerate(model.blocks):
        if isinstance(block.mlp, MoEMLP):
            block.mlp = ExpertParallelMoE(block.mlp, comm, f"ep/blocks.{i}.mlp")
            names += [f"blocks.{i}.mlp.experts.{name}" for name, _ in block.mlp.experts.named_parameters()]
    return names
