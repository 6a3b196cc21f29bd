"""Pipeline p2p traffic per step, from the schedule's placement alone.

Each microbatch crosses every boundary between consecutive virtual stages once forward (its
activation, b·s·h values) and once backward (the gradient of that activation, the same size)
(Narayanan et al. 2021 §3.2). A boundary inside one rank sends nothing. The order of the actions
does not change the bytes, only who sends them to whom, which the placement says:

    loop placement (gpipe, 1f1b, interleaved_1f1b, zbh1):  v·p - 1 crossings (p > 1)
    V placement (zbv, dualpipev):                          2(p - 1) crossings: the turn from
                                                           stage p-1 to p stays on rank p-1

    bytes per step = 2 · m · crossings · b·s·h·B      (B bytes per value)

In the V, rank r sends down the first arm to r+1 and up the second arm to r-1 (both directions,
forward and backward), so ranks 1..p-2 send twice what the ends do; in the loop every rank sends
to r+1 forward and r-1 backward, and with v > 1 the ends also wrap around (p-1 -> 0 and back).
"""

from __future__ import annotations

from collections import Counter

from parallel.pp.schedules import schedule_placement


def boundary_bytes(microbatch_size: int, seq_len: int, d_model: int, dtype_bytes: int) -> int:
    """One microbatch's activation at a stage boundary: b·s·h·B."""
    return microbatch_size * seq_len * d_model * dtype_bytes


def p2p_links(schedule: str, stages: int, microbatches: int, virtual: int, boundary: int) -> dict[tuple[int, int], int]:
    """Bytes each (sender, receiver) pair of pipeline ranks exchanges per step."""
    place = schedule_placement(schedule, stages, virtual)
    links: Counter = Counter()
    for vs in range(place.vstages - 1):
        if place.crosses(vs):
            low, high = place.rank_of(vs), place.rank_of(vs + 1)
            links[low, high] += microbatches * boundary   # the activation, forward
            links[high, low] += microbatches * boundary   # its gradient, backward
    return dict(links)


def p2p_sent_by_rank(schedule: str, stages: int, microbatches: int, virtual: int, boundary: int) -> list[int]:
    """Bytes each pipeline rank sends per step."""
    sent = [0] * stages
    for (src, _), n in p2p_links(schedule, stages, microbatches, virtual, boundary).items():
        sent[src] += n
    return sent


def p2p_bytes_per_step(schedule: str, stages: int, microbatches: int, virtual: int, boundary: int) -> int:
    """2 · m · crossings · boundary bytes for one pipeline."""
    return 2 * microbatches * schedule_placement(schedule, stages, virtual).crossings() * boundary
