"""What a call costs in bytes, and a step's calls summed.

A call's record (`Totals`) holds its payload, the bytes of the full (unsharded) tensor the
collective is about, and its sent bytes, what one rank sends under a bandwidth-optimal (ring)
algorithm, NCCL's convention (`ring_bytes_sent`), as an exact Fraction so that sums over many
calls equal the closed forms to the byte. A step's traffic maps (op, group, tag) to the sum of
its calls' records; the summaries below add them up by op, by group and by tag. Traffic the
tools add themselves (gathering metrics, reducing the loss for the log) is tagged `tooling/...`
and kept apart from the strategy's own figures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

import torch

TOOLING_PREFIX = "tooling/"


def ring_bytes_sent(op: str, payload_bytes: int, group_size: int) -> Fraction:
    """Bytes one rank sends for `op` on `payload_bytes` in a bandwidth-optimal algorithm.

    docs/theory/collectives.md (nccl-tests PERFORMANCE.md): all-reduce 2(N-1)/N S; reduce-scatter, all-gather
    and all-to-all (N-1)/N S with S the full tensor; broadcast, reduce and p2p S; a gather of objects
    S, each rank's own (the root's S is 0). An exact
    Fraction, so that sums over many calls equal the closed form to the byte.
    """
    n = group_size
    if n == 1 and op not in ("send", "recv"):
        return Fraction(0)
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n) * payload_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_gather_object"):
        return Fraction(n - 1, n) * payload_bytes
    if op in ("broadcast", "reduce", "send", "broadcast_object", "gather_object"):  # a gather: one's own, once
        return Fraction(payload_bytes)
    if op in ("recv", "barrier"):
        return Fraction(0)  # a receive sends nothing; its bytes are counted at the sender
    raise ValueError(f"no ring formula for op {op!r}")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Totals:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: Fraction = field(default_factory=Fraction)
    seconds: float = 0.0

    def add(self, other: Totals) -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.sent_bytes += other.sent_bytes
        self.seconds += other.seconds

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "payload_bytes": self.payload_bytes,
            "sent_bytes": float(self.sent_bytes),
            "seconds": round(self.seconds, 6),
        }


# One step's traffic: (op, group, tag) -> Totals
StepTraffic = dict


def is_tooling(tag: str) -> bool:
    return tag.startswith(TOOLING_PREFIX)


def summarize_traffic(traffic: StepTraffic, include_tooling: bool = False) -> dict:
    """Sum a step's (op, group, tag) records by op, by group and by tag."""
    by = {"by_op": defaultdict(Totals), "by_group": defaultdict(Totals), "by_tag": defaultdict(Totals)}
    total = Totals()
    for (op, group, tag), t in traffic.items():
        if is_tooling(tag) != include_tooling:
            continue
        by["by_op"][op].add(t)
        by["by_group"][group].add(t)
        by["by_tag"][tag].add(t)
        total.add(t)
    return {"total": total, **{k: dict(v) for k, v in by.items()}}


def traffic_by_tag_op(traffic: StepTraffic) -> dict[str, dict[str, Totals]]:
    """tag -> op -> totals in one step, strategy traffic only: which collectives each part of the
    model made (how many all-reduces each layer did, forward and backward)."""
    nested: dict[str, dict[str, Totals]] = defaultdict(lambda: defaultdict(Totals))
    for (op, _group, tag), t in traffic.items():
        if not is_tooling(tag):
            nested[tag][op].add(t)
    return {tag: dict(sorted(ops.items())) for tag, ops in sorted(nested.items())}


def calls_by_tag_op(traffic: StepTraffic) -> dict[str, dict[str, int]]:
    """tag -> op -> calls in one step (strategy traffic only)."""
    return {tag: {op: t.calls for op, t in ops.items()} for tag, ops in traffic_by_tag_op(traffic).items()}
