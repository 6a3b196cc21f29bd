"""The straggler score: how much longer a rank's compute takes than that of the ranks doing the same work.

    score(r) = C(r) / median over r's peers p of C(p)

where C is a rank's compute over the last `window` steps, and r's peers are the other ranks of its
pipeline stage (the same pp coordinate: in dp, tp and cp they do the same work, and wait for each
other at the step's collectives; two pipeline stages do different work and are not compared). A
rank whose score reaches `threshold` is flagged: logged on the console and in metrics.jsonl, and
summed up in summary.json. A rank with no peers (a pure pipeline) has no score.

The clock is CLOCK: the CPU time of the rank's training thread over the step, virtual device time's
compute clock (parallel/dist/timing.py). Wall time would not do on a machine with fewer cores than
ranks: a rank waiting for a core looks slow, and a rank that waits in a collective for a slow peer
takes the peer's time into its own step. The thread's CPU time advances only while it computes.

The times are exchanged in one all-reduce of a vector of world-size floats over the world per step,
tooling traffic (TOOLING_PREFIX), after the step's clock has stopped. On a GPU the thread's CPU time
is the host's launching, not the device's compute: the score is meant for the CPU runs, where the
replay's clock is this one (on a GPU it would take the step's CUDA time less its exposed
communication, which is not done).
"""

from __future__ import annotations

import collections
import logging
import statistics

import torch

from parallel.dist.traffic import TOOLING_PREFIX

CLOCK = "thread CPU time (time.thread_time) of each rank's training thread over the step"
TAG = f"{TOOLING_PREFIX}straggler"
log = logging.getLogger("parallel")


def straggler_scores(window: list[list[float]], peers: list[list[int]]) -> list[float | None]:
    """Each rank's score over `window` (per step, every rank's compute seconds); None without peers."""
    totals = [sum(step[r] for step in window) for r in range(len(peers))]
    scores = []
    for rank, mine in enumerate(peers):
        middle = statistics.median(totals[p] for p in mine) if mine else 0.0
        scores.append(totals[rank] / middle if middle > 0 else None)
    return scores


class StragglerMeter:
    """Every rank calls `step` once a step (a collective); rank 0 keeps the scores and flags."""

    def __init__(self, world, dims, rank: int, window: int, threshold: float, device: torch.device | None = None):
        self.world, self.rank, self.window_steps, self.threshold = world, rank, window, threshold
        self.device = device or torch.device("cpu")  # an NCCL group takes the rank's GPU's tensors only
        world_size = dims.world_size
        stage = [dims.coordinates(r)["pp"] for r in range(world_size)]
        self.peers = [[p for p in range(world_size) if p != r and stage[p] == stage[r]] for r in range(world_size)]
        self.window: collections.deque[list[float]] = collections.deque(maxlen=window)
        self.max_scores: list[float | None] = [None] * world_size
        self.first_flagged: dict[int, int] = {}

    def step(self, step: int, compute_s: float) -> dict:
        """Exchange this step's compute; on rank 0 the metrics fields, with a warning if a rank is flagged."""
        if self.world is None:
            return {}
        times = torch.zeros(self.world.size, dtype=torch.float64, device=self.device)
        times[self.rank] = compute_s
        self.world.all_reduce(times, tag=TAG)
        self.window.append(times.tolist())
        scores = straggler_scores(list(self.window), self.peers)
        flagged = [r for r, s in enumerate(scores) if s is not None and s >= self.threshold]
        for r, s in enumerate(scores):
            if s is not None:
                self.max_scores[r] = max(s, self.max_scores[r] or 0.0)
        for r in flagged:
            self.first_flagged.setdefault(r, step)
        if flagged and self.rank == 0:
            log.warning("straggler at step %d: %s (compute over the last %d steps against the median of its "
                        "peers; %s)", step, ", ".join(f"rank {r} score {scores[r]:.2f}" for r in flagged),
                        len(self.window), CLOCK)
        return {"straggler_scores": [None if s is None else round(s, 4) for s in scores], "stragglers": flagged}

    def summary(self) -> dict | None:
        if self.world is None:
            return None
        return {"clock": CLOCK, "window": self.window_steps, "threshold": self.threshold,
                "max_score": [None if s is None else round(s, 4) for s in self.max_scores],
                "first_flagged_step": {str(r): s for r, s in sorted(self.first_flagged.items())}}
