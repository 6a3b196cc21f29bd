"""Goodput, predicted: what fraction of a job's wall time trains the model that it ends with.

A job trains with steps of t seconds and saves a checkpoint after every n steps, so an interval
of training is tau = n * t, and each save blocks training for delta seconds. Failures arrive as a
Poisson process with mean time between failures M. After a failure the job pays R seconds before
it trains again (detection, teardown, restart and rendezvous, set-up, checkpoint load), and
recomputes the work done since the last complete checkpoint.

First order (Young 1974). Per interval of useful work tau the job spends tau + delta of wall time,
so saves cost delta / tau of it. A failure lands, on average, half-way through an interval: it
loses tau / 2 of work (plus what was in flight) and costs R to recover. Failures come 1/M per
second of wall time, so

    goodput = useful time / wall time  ~=  1 - delta / tau - (tau / 2 + R) / M

The two interval terms pull in opposite directions; d/dtau = delta / tau^2 - 1 / (2 M) = 0 gives
Young's optimum tau = sqrt(2 delta M). Daly (2006) keeps the higher-order terms: with exponential
failures, which may also strike during a save or a restart, the expected wall time per useful
second is exactly

    wall / useful = M e^(R/M) (e^((tau + delta)/M) - 1) / tau

whose first-order optimum is tau* = sqrt(2 delta M) - delta (for delta < 2 M; beyond that, save
once per M). Both reduce to 1 - delta/tau - (tau/2 + R)/M when tau, delta and R are small beside M.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GoodputInputs:
    """The model's inputs, in seconds: step time t, steps per checkpoint n, save cost delta,
    restart cost R, mean time between failures M."""

    step_s: float
    steps_per_checkpoint: int
    save_s: float
    restart_s: float
    mtbf_s: float

    @property
    def interval_s(self) -> float:
        """tau: the training time between two checkpoints."""
        return self.steps_per_checkpoint * self.step_s

    def as_dict(self) -> dict:
        return {**asdict(self), "interval_s": self.interval_s}


def first_order_goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Young's first-order goodput 1 - delta/tau - (tau/2 + R)/M, floored at 0."""
    if tau <= 0 or mtbf <= 0:
        raise ValueError(f"the interval ({tau}) and the mean time between failures ({mtbf}) must be positive")
    return max(0.0, 1.0 - delta / tau - (tau / 2 + restart) / mtbf)


def daly_goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Daly's exact goodput for exponential failures (failures during saves and restarts included)."""
    if tau <= 0 or mtbf <= 0:
        raise ValueError(f"the interval ({tau}) and the mean time between failures ({mtbf}) must be positive")
    exponent = (tau + delta) / mtbf
    if exponent + restart / mtbf > 700:  # past a float's range: the job never finishes an interval
        return 0.0
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1(exponent))


def young_interval(delta: float, mtbf: float) -> float:
    """Young's optimum interval sqrt(2 delta M)."""
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's first-order optimum sqrt(2 delta M) - delta, for delta < 2 M; else M."""
    if delta >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * delta * mtbf) - delta


def with_startup(goodput: float, startup_s: float, useful_s: float) -> float:
    """A whole job's goodput when it also pays a one-time start-up S0 (its first attempt's set-up,
    which no interval amortises) for U seconds of useful work: U / (S0 + U / goodput). It matters
    for short jobs: a few seconds of start-up in a job of minutes is a point or more."""
    if goodput <= 0:
        return 0.0
    return useful_s / (startup_s + useful_s / goodput)


def predict(inputs: GoodputInputs) -> dict:
    """Both models' goodput at the inputs' interval, and the optimum interval in seconds and steps."""
    tau, delta, restart, mtbf = inputs.interval_s, inputs.save_s, inputs.restart_s, inputs.mtbf_s
    best = daly_interval(delta, mtbf)
    return {
        "first_order": first_order_goodput(tau, delta, restart, mtbf),
        "daly": daly_goodput(tau, delta, restart, mtbf),
        "best_interval_s": best,
        "best_steps_per_checkpoint": max(1, round(best / inputs.step_s)) if inputs.step_s > 0 else None,
        "inputs": inputs.as_dict(),
    }
