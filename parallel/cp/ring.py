"""Ring attention: causal attention over a sequence split across the cp ranks of a ring.

Liu et al. 2023 (Ring Attention, arXiv 2310.01889); Megatron-Core's context parallelism with
cp_comm_type="p2p". Rank r holds the queries, keys and values of its own tokens (two chunks of
the load-balanced layout, parallel/cp/layout.py). The keys and values travel: at step i = 0..cp−1
rank r holds the K, V block of rank (r − i) mod cp, attends its queries to it, and meanwhile
passes it on to rank r + 1 and receives the next one from rank r − 1. After cp steps its queries
have seen every key, merged block by block with the online softmax (parallel/cp/blockwise.py).
The send of the next block is posted before the current block is computed, so the transfer can
hide behind the computation.

Each step attends only the (query chunk, key chunk) pairs that the causal mask leaves: with the
load-balanced layout, step 0 (the rank's own block) has the two diagonal chunks and one full pair,
and every other step exactly two full pairs, so all ranks do the same work.

Backward, each rank recomputes its blocks from the final lse. It needs every K, V block again,
and they travel the ring a second time (keeping all of them from the forward would hold
(cp − 1)/cp of the layer's full K and V on every rank: the memory context parallelism exists to
save). The gradient of a K, V block is summed over all cp ranks and must end on the rank that owns
the block: the owner keeps its own share, and an fp32 (or wider) accumulator for the block rides the ring
behind it from the next rank on, gathering each rank's share, and comes home after cp − 1 hops.

With grouped-query attention K and V have fewer heads than Q (a_kv): they travel unexpanded,
and each kv head meets the a/a_kv query heads it serves inside the block (parallel/cp/blockwise.py),
so a hop carries a_kv heads, not a: GQA's saving in memory is the ring's saving in bytes.

Bytes each rank sends per layer and microbatch (tags `<tag>/fwd`, `<tag>/bwd`):
    forward   (cp − 1) sends of K and V      2·b·a_kv·(s/cp)·d elements of the activation dtype
    backward  (cp − 1) sends of K and V again, and (cp − 1) sends of the dK, dV accumulator, in fp32
              (in float64 for float64 activations: the accumulator is never narrower than fp32)
(parallel/cp/theory.py; derivation in docs/theory/context.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.cp.blockwise import CAUSAL, EMPTY, block_backward, block_forward, block_kind, merge
from parallel.cp.layout import rank_chunks
from parallel.dist.comm import Communicator

SEQ = -2  # attention tensors are (batch, heads, seq, head_dim)


def _ring_step(comm: Communicator, outgoing: torch.Tensor, tag: str):
    """Post: send `outgoing` to the next rank, receive the same shape from the previous one.

    Two ranks' messages are matched in the order they are posted (gloo and NCCL alike), and every
    rank posts the same sequence (in backward: the K, V block, then the gradient accumulator,
    step after step), so a receive always gets the message meant for it.
    """
    incoming = torch.empty_like(outgoing)
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    handles = comm.batch_p2p([("send", outgoing, nxt, tag), ("recv", incoming, prev, tag)])
    return incoming, handles


def _wait(handles) -> None:
    for handle in handles:
        handle.wait()


def _heads_inner(out: torch.Tensor) -> torch.Tensor:
    """(b, a, n, d) laid out in memory as (b, n, a, d), as PyTorch's SDPA lays out its output: the
    block then merges the heads back into (b, n, a·d) as a view, so in fp32 the tensor saved here
    for backward is the very one the output projection saves (one b·n·h buffer per layer, not two)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, a, n, d) -> (b, a_kv, a/a_kv, n, d): the query heads each kv head serves, side by side (a view)."""
    return x.unflatten(1, (kv_heads, -1))


def _pairs(rank: int, source: int, cp: int):
    """(local query chunk, source key chunk, causal?) for each pair the causal mask does not empty."""
    for qi, query_chunk in enumerate(rank_chunks(rank, cp)):
        for ki, key_chunk in enumerate(rank_chunks(source, cp)):
            kind = block_kind(query_chunk, key_chunk)
            if kind != EMPTY:
                yield qi, ki, kind == CAUSAL


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Communicator, tag: str):
        cp, rank = comm.size, comm.rank
        scale = q.shape[-1] ** -0.5
        # Blocks are computed in fp32 (or wider) whatever the activations are (bf16 under
        # autocast); K and V travel in their own dtype, as they would without context parallelism.
        exact = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q_chunks = _grouped(q.to(exact), k.shape[1]).chunk(2, dim=SEQ)
            kv = torch.stack((k, v))
            outs, lses = [None, None], [None, None]
            for step in range(cp):
                if step < cp - 1:
                    incoming, handles = _ring_step(comm, kv, f"{tag}/fwd")
                k_chunks, v_chunks = (t.to(exact).chunk(2, dim=SEQ) for t in kv)
                for qi, ki, causal in _pairs(rank, (rank - step) % cp, cp):
                    block = block_forward(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal, scale)
                    # Step 0 (the rank's own block) gives every query chunk its diagonal first.
                    outs[qi], lses[qi] = block if outs[qi] is None else merge(outs[qi], lses[qi], *block)
                if step < cp - 1:
                    _wait(handles)
                    kv = incoming
            out, lse = _heads_inner(torch.cat(outs, dim=SEQ).flatten(1, 2)), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.tag = comm, tag
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, tag = ctx.comm, f"{ctx.tag}/bwd"
        cp, rank = comm.size, comm.rank
        scale = q.shape[-1] ** -0.5
        exact, kv_heads = out.dtype, k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            dout = _grouped(grad_out.to(exact), kv_heads)
            delta = (dout * _grouped(out, kv_heads)).sum(-1)
            q_chunks, dout_chunks = _grouped(q.to(exact), kv_heads).chunk(2, dim=SEQ), dout.chunk(2, dim=SEQ)
            lse_chunks, delta_chunks = lse.chunk(2, dim=-1), delta.chunk(2, dim=-1)
            dq = torch.zeros_like(dout)
            dq_chunks = dq.chunk(2, dim=SEQ)
            kv = torch.stack((k, v))
            own_dkv = carried = carried_handles = None
            for step in range(cp):
                if step < cp - 1:
                    incoming, handles = _ring_step(comm, kv, tag)
                k_chunks, v_chunks = (t.to(exact).chunk(2, dim=SEQ) for t in kv)
                dkv = torch.zeros_like(kv, dtype=exact)  # this rank's share for the block it holds
                dk_chunks, dv_chunks = dkv[0].chunk(2, dim=SEQ), dkv[1].chunk(2, dim=SEQ)
                for qi, ki, causal in _pairs(rank, (rank - step) % cp, cp):
                    dq_b, dk_b, dv_b = block_backward(q_chunks[qi], k_chunks[ki], v_chunks[ki], dout_chunks[qi],
                                                      lse_chunks[qi], delta_chunks[qi], causal, scale)
                    dq_chunks[qi].add_(dq_b)
                    dk_chunks[ki].add_(dk_b)
                    dv_chunks[ki].add_(dv_b)
                if step == 0:
                    own_dkv = dkv  # the owner's share stays home
                else:
                    if carried_handles is not None:  # the accumulator for this block, from rank r − 1
                        _wait(carried_handles)
                        dkv += carried
                    carried, carried_handles = _ring_step(comm, dkv, tag)
                if step < cp - 1:
                    _wait(handles)
                    kv = incoming
            if carried_handles is not None:  # the accumulator of this rank's own block, home
                _wait(carried_handles)
                own_dkv += carried
        return dq.flatten(1, 2).to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype), None, None


class RingAttentionCore(nn.Module):
    """Drop-in for the model's AttentionCore on one rank of a cp ring.

    q: (batch, heads, 2·c, head_dim), this rank's two chunks of the load-balanced layout; k, v the
    same with kv heads (fewer under grouped-query attention, dividing the heads). `tag` names the
    layer in the communication log, e.g. "cp/blocks.3.attn".
    """

    def __init__(self, comm: Communicator, tag: str):
        super().__init__()
        self.comm, self.tag = comm, tag

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.comm, self.tag)
