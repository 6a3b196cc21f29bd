"""All-to-all bytes of expert parallelism, from the routing (exact) and under uniform routing (expected).

Pure functions of counts and shapes; independent of the dispatch code they check
(parallel/moe/expert_parallel.py). Derivation: docs/theory/experts.md.

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
