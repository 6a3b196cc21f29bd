"""Which bytes the communication log says cross between nodes, under the algorithms gloo runs.

comm.py records, per rank and step, each call's op, group, tag and payload S (the full tensor the
collective is about). That fixes how many bytes the rank sends, but not where they go: for that,
the algorithm gloo runs on CPU tensors (torch 2.13's ProcessGroupGloo and its gloo; checked
against the interface counters, docs/network-bytes.md) gives each rank's transfers. For the member at
position i of a group of n (positions in group-rank order):

  all_reduce      ring (gloo/allreduce.cc, ring()). S is cut into N = roundUp(max(ceil(S / 1 MiB),
                  2n), n) segments of whole elements, n chunks of N/n segments; a reduce-scatter
                  phase then an all-gather phase, each sending every non-empty segment but one
                  chunk's to the left neighbour i-1: 2S - chunk(i) - chunk(i-1) bytes, about
                  2(n-1)/n * S.
  reduce_scatter  ProcessGroupGloo::reduce_scatter_tensor_coalesced is an all-reduce of the full
                  input and a slice: the all-reduce's transfers, twice the (n-1)/n * S of a ring
                  reduce-scatter that comm.py counts.
  all_gather      ring (gloo/allgather.cc): 2(n-1) half-blocks of S/(2n) to the right neighbour i+1.
  broadcast       binomial tree from the root (gloo/broadcast.cc): virtual rank v = i - root mod n
                  sends S to v + 2^j for every j with v < 2^j and v + 2^j < n. The root is taken as
                  group rank 0 (the log does not keep it; every broadcast here is from rank 0).
  all_to_all      its block to each other member: with even splits S/n each; with a router's uneven
                  splits (ep) the bytes it really sent, which the log keeps (comm.py), over its n-1
                  peers (exact for n = 2; the log does not keep how they split among more).
  send            S to the peer: the other member of a group of two, else the peer the tag names
                  (`.../<a>-><b>`: pipeline virtual stages, owned by b mod n).
  recv, barrier   nothing (a receive's bytes are its sender's; a barrier is a few bytes).

Each transfer of L bytes also puts framing on the wire (`framing`): gloo's tcp transport sends a
48-byte header with the data, and sender and receiver each announce the transfer to the other
with a 48-byte message; every frame carries 66 bytes of Ethernet (14), IP (20) and TCP (20 + 12 of
timestamps) headers (52 in the loopback's counters, which leave the Ethernet header out); the data
goes in F = ceil((L + 48) / MSS) frames, the receiver acknowledges every second one (ceil(F/2)
ACKs, RFC 5681 4.2's delayed ACK). About 400 bytes per transfer: under 1% of a transfer above 40
KB, and most of a 4-byte one.

Elements are taken as 4 bytes (fp32) to cut segments; for another dtype (parallel.comm_dtype=bf16's
all-reduce) the rounding moves a few bytes per call. The int8 and fp8 collectives are an all-to-all
and an all-gather of byte tensors, whose blocks the rules above place exactly; HSDP's groups
(dp_shard, dp_replicate) are groups like any other. Calls logged under one (op, group, tag) are taken as equal in
size (the log sums their payloads).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_PEER_IN_TAG = re.compile(r"/(\d+)->(\d+)$")

SEGMENT_BYTES = 1 << 20      # gloo's AllreduceOptions kMaxSegmentSize
ELEMENT_BYTES = 4
GLOO_HEADER = 48             # gloo tcp Op preamble: six 8-byte fields
TCP_IP_HEADERS = 52          # IPv4 20 + TCP 20 + timestamps option 12: what the MSS leaves out of the MTU
# Header bytes a frame adds to an interface's counters: Ethernet's 14 more on a veth; the loopback
# counts a frame after taking its Ethernet header off (loopback_xmit, after eth_type_trans).
FRAME_HEADERS = {"inter": TCP_IP_HEADERS + 14, "intra": TCP_IP_HEADERS}


class PredictionError(ValueError):
    """A logged call whose destinations cannot be told (an op without a rule, a send without a peer)."""


@dataclass(frozen=True)
class Transfers:
    """`count` transfers of `nbytes` each from one member to the member at group position `to`."""

    to: int
    nbytes: int
    count: int


def framing(nbytes: int, mtu: int, frame_headers: int = FRAME_HEADERS["inter"]) -> int:
    """Bytes on the wire beyond the payload for one gloo transfer of `nbytes` over a link of `mtu`
    whose counters see `frame_headers` bytes of headers per frame."""
    frames = max(1, math.ceil((nbytes + GLOO_HEADER) / (mtu - TCP_IP_HEADERS)))
    acks = math.ceil(frames / 2)
    return 3 * GLOO_HEADER + frame_headers * (frames + 2 + acks)


def _ring_allreduce(s: int, n: int, i: int) -> list[Transfers]:
    """gloo's ring all-reduce: the non-empty segments member i sends to i-1, by size."""
    segments = math.ceil(max(math.ceil(s / SEGMENT_BYTES), 2 * n) / n) * n
    per_chunk = segments // n
    seg = math.ceil(math.ceil(s / segments) / ELEMENT_BYTES) * ELEMENT_BYTES
    sizes = [max(0, min(seg, s - k * seg)) for k in range(segments)]

    def outside_chunk(c: int) -> list[int]:
        return [size for k, size in enumerate(sizes) if k // per_chunk != c and size > 0]

    sent = outside_chunk(i) + outside_chunk((i - 1) % n)  # reduce-scatter phase, then all-gather phase
    by_size: dict[int, int] = {}
    for size in sent:
        by_size[size] = by_size.get(size, 0) + 1
    return [Transfers((i - 1) % n, size, count) for size, count in by_size.items()]


def _binomial_children(v: int, n: int) -> list[int]:
    """Virtual ranks that virtual rank v sends to in gloo's binomial-tree broadcast (root = 0)."""
    children, step = [], 1
    while step < n:
        if v < step and v + step < n:
            children.append(v + step)
        step *= 2
    return children


def transfers(op: str, payload: int, n: int, i: int, tag: str = "", root: int = 0,
              sent: int | None = None) -> list[Transfers]:
    """What the member at position i of a group of n sends for one call of `op` on `payload` bytes.
    `sent`: the bytes the log says the call sent (used by all_to_all, whose splits can be uneven)."""
    if n == 1 or op in ("recv", "barrier"):
        return []
    if op in ("all_reduce", "reduce_scatter"):
        return _ring_allreduce(payload, n, i)
    if op == "all_gather":
        block = payload // n
        return [Transfers((i + 1) % n, block // 2, n - 1), Transfers((i + 1) % n, block - block // 2, n - 1)]
    if op == "all_to_all":
        block = payload // n if sent is None else sent // (n - 1)
        return [Transfers(j, block, 1) for j in range(n) if j != i]
    if op == "broadcast":
        v = (i - root) % n
        return [Transfers((c + root) % n, payload, 1) for c in _binomial_children(v, n)]
    if op == "send":
        if n == 2:
            return [Transfers(1 - i, payload, 1)]
        m = _PEER_IN_TAG.search(tag)
        if m is None:
            raise PredictionError(f"a send tagged {tag!r} in a group of {n}: the tag does not name its peer "
                                  "(.../<a>-><b>)")
        return [Transfers(int(m.group(2)) % n, payload, 1)]
    raise PredictionError(f"no rule for where gloo's {op!r} sends its bytes (tag {tag!r})")


def step_bytes(traffic: Mapping, groups: Mapping[str, list[int]], rank: int, node_of: Mapping[int, int],
               mtu: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """One rank's step: for "inter" (to other nodes) and "intra" (to its own node), the payload
    bytes and the wire bytes (payload + framing over a link of mtu[kind]).

    `traffic` is the rank's CommLog step record ((op, group, tag) -> Totals, or a dict with calls
    and payload_bytes); `groups` maps each group name to the rank's group members (global ranks, in
    group-rank order); `node_of` maps every global rank to its node.
    """
    out = {kind: {"payload": 0.0, "wire": 0.0} for kind in ("inter", "intra")}
    for (op, group, tag), totals in traffic.items():
        if isinstance(totals, Mapping):
            calls, payload, sent = totals["calls"], totals["payload_bytes"], totals.get("sent_bytes")
        else:
            calls, payload, sent = totals.calls, totals.payload_bytes, totals.sent_bytes
        if not calls:
            continue
        members = groups[group]
        per_call = round(payload / calls)
        sent_per_call = None if sent is None else round(sent / calls)
        for t in transfers(op, per_call, len(members), members.index(rank), tag, sent=sent_per_call):
            kind = "intra" if node_of[members[t.to]] == node_of[rank] else "inter"
            out[kind]["payload"] += calls * t.count * t.nbytes
            out[kind]["wire"] += calls * t.count * (t.nbytes + framing(t.nbytes, mtu[kind], FRAME_HEADERS[kind]))
    return out


def per_step(rank_steps: Mapping[int, Iterable[Mapping]], rank_groups: Mapping[int, Mapping[str, list[int]]],
             node_of: Mapping[int, int], mtu: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Mean over the given steps of what all ranks send between nodes and within nodes.

    `rank_steps[r]` is rank r's list of step records (the timed steps), `rank_groups[r]` its groups.
    """
    totals = {kind: {"payload": 0.0, "wire": 0.0} for kind in ("inter", "intra")}
    n_steps = 0
    for rank, steps in rank_steps.items():
        steps = list(steps)
        n_steps = max(n_steps, len(steps))
        for traffic in steps:
            for kind, figures in step_bytes(traffic, rank_groups[rank], rank, node_of, mtu).items():
                for name, value in figures.items():
                    totals[kind][name] += value
    return {kind: {name: value / n_steps if n_steps else 0.0 for name, value in figures.items()}
            for kind, figures in totals.items()}
