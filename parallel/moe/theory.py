"""Expert parallelism's closed forms: the all-to-all bytes from the routing (exact) and under uniform
routing (expected), the gradient sums over dp and edp, and what each ep rank holds.

Pure functions of counts and shapes; independent of the dispatch code they check
(parallel/moe/expert_parallel.py) and of the communication log. Derivation: docs/theory/experts.md.

Notation: n ep ranks, E experts (E/n per rank, rank j holds experts [j·E/n, (j+1)·E/n)), rows of
h elements of B bytes. counts[r][e] = kept assignments of rank r's tokens to expert e in one MoE
block and microbatch (after dropping). For rank r:

  A_r   = Σ_e counts[r][e]                      rows it dispatches (its kept assignments)
  R_r   = Σ_q Σ_{e on r} counts[q][e]           rows its experts receive (from every source)
  out_r = A_r - Σ_{e on r} counts[r][e]         rows it sends to other ranks
  in_r  = R_r - Σ_{e on r} counts[r][e]         rows other ranks send to it

An all-to-all's payload is this rank's whole input and `sent` the part for other ranks
(parallel/dist/comm.py). Per MoE block and microbatch, rank r records:

  counts        payload E·8          sent (n-1)·E/n·8      (int64 split sizes)
  dispatch/fwd  payload A_r·h·B      sent out_r·h·B        (rows to the experts)
  combine/fwd   payload R_r·h·B      sent in_r·h·B         (expert outputs back to their sources)
  dispatch/bwd  payload R_r·h·B      sent in_r·h·B         (input gradients back to the sources)
  combine/bwd   payload A_r·h·B      sent out_r·h·B        (output gradients to the experts)

so 2·(out_r + in_r)·h·B + (n-1)·E/n·8 bytes sent by rank r, and over all ranks
4·h·B·Σ_r out_r + (n-1)·E·8 (every row sent out is received once: Σ out_r = Σ in_r).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from parallel.algebra import all_reduce_sent_per_rank, expert_parameters, figure, parameter_count
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.model_state import model_state, run_state_bytes, whole_model_parts

COUNT_BYTES = 8  # the split sizes travel as int64

CALLS = ("counts", "dispatch/fwd", "combine/fwd", "dispatch/bwd", "combine/bwd")


@dataclass(frozen=True)
class CallBytes:
    payload: int  # bytes of this rank's input to the all-to-all
    sent: int     # bytes of it that go to other ranks


def rank_rows(counts: Sequence[Sequence[int]]) -> list[dict[str, int]]:
    """A_r, R_r, out_r, in_r for every rank r from counts[r][e] (n rows of E counts)."""
    n, experts = len(counts), len(counts[0])
    if experts % n:
        raise ValueError(f"{experts} experts do not divide over {n} ranks")
    per = experts // n
    rows = []
    for r in range(n):
        local = range(r * per, (r + 1) * per)
        kept_here = sum(counts[r][e] for e in local)
        dispatched = sum(counts[r])
        received = sum(counts[q][e] for q in range(n) for e in local)
        rows.append({"dispatched": dispatched, "received": received,
                     "out": dispatched - kept_here, "in": received - kept_here})
    return rows


def layer_call_bytes(counts: Sequence[Sequence[int]], d_model: int, dtype_bytes: int) -> list[dict[str, CallBytes]]:
    """Per rank: the five all-to-alls of one MoE block and microbatch (forward and backward)."""
    n, experts = len(counts), len(counts[0])
    row = d_model * dtype_bytes
    calls = []
    for r in rank_rows(counts):
        a, rcv = r["dispatched"] * row, r["received"] * row
        out, inn = r["out"] * row, r["in"] * row
        calls.append({
            "counts": CallBytes(experts * COUNT_BYTES, (n - 1) * (experts // n) * COUNT_BYTES),
            "dispatch/fwd": CallBytes(a, out),
            "combine/fwd": CallBytes(rcv, inn),
            "dispatch/bwd": CallBytes(rcv, inn),
            "combine/bwd": CallBytes(a, out),
        })
    return calls


def exact_sent_per_rank(counts_per_call: Sequence[Sequence[Sequence[int]]], d_model: int,
                        dtype_bytes: int) -> list[int]:
    """Bytes each rank sends in one step: the sum over every (MoE block, microbatch) of its counts
    matrix, of 2·(out_r + in_r)·h·B + (n-1)·E/n·8."""
    totals: list[int] | None = None
    for counts in counts_per_call:
        per_rank = [sum(c.sent for c in calls.values()) for calls in layer_call_bytes(counts, d_model, dtype_bytes)]
        totals = per_rank if totals is None else [t + p for t, p in zip(totals, per_rank)]
    return totals or []


def uniform_sent_per_rank(tokens: int, top_k: int, d_model: int, experts: int, ep: int, dtype_bytes: int,
                          moe_blocks: int = 1, microbatches: int = 1) -> Fraction:
    """Expected bytes one rank sends per step under uniform routing with nothing dropped:

        m · L_moe · [ 4 · (n-1)/n · T·k·h·B  +  (n-1)/n · E·8 ]

    T tokens per rank and microbatch, each with k assignments, each to an expert on another rank
    with probability (n-1)/n; four all-to-alls of rows (dispatch and combine, forward and
    backward) and the counts. It is the exact figure when every sequence sends exactly s·k/E
    assignments to each expert, and the expectation (linearity) when each assignment picks its
    expert uniformly at random; dropping only lowers it (docs/theory/experts.md).
    """
    n = ep
    rows = Fraction(4 * (n - 1), n) * tokens * top_k * d_model * dtype_bytes
    counts = Fraction(n - 1, n) * experts * COUNT_BYTES
    return microbatches * moe_blocks * (rows + counts)


# -- per step, on the model and a Layout (parallel/moe/strategy.py) -----------------------------------
def ep_shard_parameter_count(model: GPTConfig, ep: int) -> int:
    """Parameters one expert-parallel rank holds: everything but the experts whole, and E/ep of each
    MoE block's experts: Ψ - L_moe·(E - E/ep)·(2f·h + f + h)."""
    E = model.moe_experts
    return parameter_count(model) - len(model.moe_blocks) * (E - E // ep) * expert_parameters(model)


def ep_dense_parameter_count(model: GPTConfig) -> int:
    """What every dp rank holds whole under expert parallelism, and sums over all dp ranks: the model
    but its experts (the routers included), Ψ - L_moe·E·(2f·h + f + h)."""
    return parameter_count(model) - len(model.moe_blocks) * model.moe_experts * expert_parameters(model)


def ep_expert_parameter_count(model: GPTConfig, ep: int) -> int:
    """The experts one of `ep` expert-parallel ranks holds, summed over its edp group only:
    L_moe·(E/ep)·(2f·h + f + h)."""
    return len(model.moe_blocks) * (model.moe_experts // ep) * expert_parameters(model)


def ep_model_state_bytes(model: GPTConfig, layout: Layout) -> dict:
    """One expert-parallel rank's model state (every rank alike): its Ψ_ep parameters in fp32, their
    gradients, and Adam's two moments, 4Ψ_ep + 4Ψ_ep + 8Ψ_ep bytes, Ψ_ep = `ep_shard_parameter_count`:
    every part, each MoE block with E/ep of its experts (parallel/model_state.py)."""
    parts = whole_model_parts(ModelShape(gpt=model), ep=layout.dims.ep)
    return model_state(parts, run_state_bytes(layout.dtype_bytes))


def ep_local_parameter_count(model: GPTConfig, layout: Layout) -> int:
    """What rank 0 holds under expert parallelism: Ψ_ep."""
    return ep_shard_parameter_count(model, layout.dims.ep)


def ep_all_to_all_uniform_bytes(model: GPTConfig, layout: Layout) -> Fraction:
    """Bytes one expert-parallel rank sends per step in its all-to-alls under uniform routing with
    nothing dropped (the planner's figure; a run's exact one follows its routing, `ep_comm`):

        m · L_moe · [ 4 · (n-1)/n · T·k·h·B  +  (n-1)/n · E·8 ]      T = b·s tokens per microbatch
    """
    tokens = layout.microbatch_size * model.seq_len
    return uniform_sent_per_rank(tokens, model.moe_top_k, model.d_model, model.moe_experts, layout.dims.ep,
                                 layout.dtype_bytes, len(model.moe_blocks), layout.microbatches)


def ep_all_to_all_pair_bytes_uniform(model: GPTConfig, layout: Layout) -> Fraction:
    """Bytes one expert-parallel rank sends to each one of the n-1 others per step under uniform
    routing, m · L_moe · [4·T·k/n·h·B + E/n·8]: what a planner puts on the link between two ep ranks
    (an intra-node or an inter-node one, by where it places them); (n-1) of these make
    `ep_all_to_all_uniform_bytes`."""
    n = layout.dims.ep
    return ep_all_to_all_uniform_bytes(model, layout) / (n - 1) if n > 1 else Fraction(0)


def ep_all_to_all_exact(model: GPTConfig, layout: Layout) -> tuple[int, Fraction]:
    """(payload, sent) of every rank's all-to-alls in the step whose routing the layout holds: per ep
    group and MoE call, the five calls of `layer_call_bytes` on that call's counts matrix."""
    payload, sent = 0, Fraction(0)
    for group in layout.dims.group_ranks("ep"):
        calls = {len(layout.routing[r]) for r in group}
        if len(calls) != 1:
            raise ValueError(f"the ranks of ep group {group} report different numbers of MoE calls: {sorted(calls)}")
        for call in range(calls.pop()):
            counts = [list(layout.routing[r][call]) for r in group]
            for rank_calls in layer_call_bytes(counts, model.d_model, layout.dtype_bytes):
                payload += sum(c.payload for c in rank_calls.values())
                sent += sum(c.sent for c in rank_calls.values())
    return payload, sent


def ep_comm(model: GPTConfig, layout: Layout) -> dict:
    """Expert parallelism inside data parallelism (d = dp ranks, n = ep of them per expert group):

      dp   every rank all-reduces the gradients of the dense parts and routers, Ψ_dense·B, over dp:
           2(d-1)/d · Ψ_dense·B per rank
      edp  every rank all-reduces its experts' gradients, L_moe·(E/n)·(2f·h + f + h)·B, over the d/n
           ranks that hold the same experts: 2(d/n-1)/(d/n) of it per rank (nothing when d = n)
      ep   per MoE block and microbatch, the counts and four row all-to-alls: exactly what the
           routing in `layout.routing` sends (`ep_all_to_all_exact`), or, for a layout never run,
           the uniform-routing figure of `ep_all_to_all_uniform_bytes` (an expectation)

    `all_to_all` in the result says which (`routing`: "measured" or "uniform") and gives the uniform
    figure beside the exact one, summed over all ranks.
    """
    dims, B = layout.dims, layout.dtype_bytes
    d, n, ranks = dims.dp, dims.ep, dims.world_size
    dense = ep_dense_parameter_count(model) * B
    experts = ep_expert_parameter_count(model, n) * B
    dp_sent = all_reduce_sent_per_rank(d, dense) * ranks
    edp_sent = all_reduce_sent_per_rank(d // n, experts) * ranks
    uniform = ep_all_to_all_uniform_bytes(model, layout) * ranks
    tokens = layout.microbatch_size * model.seq_len
    if layout.routing is None:
        # Uniform routing: every call's input holds the counts and T·k rows (dispatch, combine, twice).
        per_call = model.moe_experts * COUNT_BYTES + 4 * tokens * model.moe_top_k * model.d_model * B
        a2a_payload, a2a_sent = per_call * len(model.moe_blocks) * layout.microbatches * ranks, uniform
    else:
        a2a_payload, a2a_sent = ep_all_to_all_exact(model, layout)
    totals = {"all_reduce": ((dense + (experts if d > n else 0)) * ranks, dp_sent + edp_sent),
              "all_to_all": (a2a_payload, a2a_sent)}
    extra = {"all_to_all": {"routing": "uniform" if layout.routing is None else "measured",
                            "sent_bytes": float(a2a_sent), "sent_bytes_exact": str(a2a_sent),
                            "uniform_sent_bytes": float(uniform), "uniform_sent_bytes_exact": str(uniform)}}
    return figure(totals, ranks, {"dp": dp_sent, "edp": edp_sent, "ep": a2a_sent}, extra)
