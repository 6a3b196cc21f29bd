"""`compare.rounds=N`: the sweep repeated N times, its order rotated each round, one row per strategy.

The order of a round is built from units: each of our strategies with its PyTorch counterpart
when both are swept (the first of ours to name it; `partners`), placed where the first of the two
is listed, every other strategy alone.
Round k runs the units in the given order rotated left by k, so that no strategy is always the
first on a cold machine or always the one after the same neighbour, and inside a pair ours runs
first in even rounds and PyTorch's first in odd ones. A pair's two runs are therefore always
neighbours, one run apart, whatever the rotation, and the machine's drift between two runs (a
minute) is charged to each side equally often. A rotation of the plain list would split one pair
per round across the whole sweep, its two runs at opposite ends of a round, and a machine that
slows or speeds up within the round would be charged to one side only. Every run of every round is
a process of its own.

A strategy's row over its rounds:

    tokens_per_s, step_ms, and every other figure (bytes, memory, losses, time breakdown)
                                    the median round's run, by tokens/s (the lower middle for an
                                    even count; `round` says which), so that a row's figures are
                                    one run's and add up (its breakdown sums to its step)
    tokens_per_s_lo, tokens_per_s_hi  the slowest and the fastest round: the interval is min-max
                                    over rounds (with 3 rounds a percentile interval would be
                                    these same two numbers; with one round there is none)
    ratio_to_baseline, ratio_lo, ratio_hi
                                    per round ours / the counterpart's in that same round (two
                                    neighbouring runs), then the median and min-max of those ratios
    speedup_vs_single, speedup_note  the median round's run's, against `single` in that round
    step_ms_min, step_ms_max        over every timed step of every round, and spread / noisy
                                    from them (spread: their difference over the median round's step)
    rounds_ok                       how many rounds ran it; a strategy that failed in some rounds
                                    keeps the first error
"""

from __future__ import annotations

import statistics

from parallel.compare.clock import apply as apply_clock
from parallel.compare.networks import Network, net_columns
from parallel.compare.rows import NOISY_SPREAD, add_baseline_ratios, failed_row, row_from_summary
from parallel.compare.speedup import add_speedups


def units(strategies: list[str], partners: dict[str, str]) -> list[list[str]]:
    """The sweep's strategies as units, placed where the first of the two is listed: [ours,
    counterpart] where `partners` maps ours to a swept counterpart not already taken (whichever of
    the two is listed first), [name] otherwise."""
    swept = set(strategies)
    pairs = {}  # each side of a pair -> (ours, theirs), the first of ours listed taking a counterpart
    for ours in strategies:
        theirs = partners.get(ours)
        if theirs in swept and theirs != ours and ours not in pairs and theirs not in pairs:
            pairs[ours] = pairs[theirs] = (ours, theirs)
    placed: set[str] = set()
    out = []
    for name in strategies:
        if name in placed:
            continue
        unit = list(pairs.get(name, (name,)))
        placed.update(unit)
        out.append(unit)
    return out


def round_order(strategies: list[str], k: int, partners: dict[str, str] | None = None) -> list[str]:
    """The order of round k: the units rotated left by k, each pair ours-first in even rounds and
    PyTorch's-first in odd ones (the module docstring says why)."""
    groups = units(strategies, partners or {})
    if not groups:
        return []
    shift = k % len(groups)
    groups = groups[shift:] + groups[:shift]
    return [name for unit in groups for name in (unit if k % 2 == 0 else unit[::-1])]


def _interval(values: list[float]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max); no interval from fewer than two values."""
    if not values:
        return None, None, None
    if len(values) == 1:
        return values[0], None, None
    return statistics.median(values), min(values), max(values)


def aggregate_rounds(rounds: list[list[dict]], strategies: list[str]) -> list[dict]:
    """One row per strategy (in `strategies` order) from every round's rows (ratios already set)."""
    rows = []
    for name in strategies:
        runs = [row for round_rows in rounds for row in round_rows if row["strategy"] == name]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            rows.append({**runs[0], "rounds_ok": 0})
            continue
        by_speed = sorted(ok, key=lambda r: r["tokens_per_s"])
        row = dict(by_speed[(len(by_speed) - 1) // 2])  # the median run (the lower middle for an even count)
        _, row["tokens_per_s_lo"], row["tokens_per_s_hi"] = _interval([r["tokens_per_s"] for r in ok])
        ratios = [r["ratio_to_baseline"] for r in ok if r["ratio_to_baseline"] is not None]
        row["ratio_to_baseline"], row["ratio_lo"], row["ratio_hi"] = _interval(ratios)
        row["step_ms_min"] = min(r["step_ms_min"] for r in ok)
        row["step_ms_max"] = max(r["step_ms_max"] for r in ok)
        timed_steps = len(ok) > 1 or row["spread"] is not None
        row["spread"] = (row["step_ms_max"] - row["step_ms_min"]) / row["step_ms"] if timed_steps else None
        row["noisy"] = None if row["spread"] is None else row["spread"] > NOISY_SPREAD
        row["rounds_ok"] = len(ok)
        failed = [r for r in runs if r["status"] != "ok"]
        if failed:
            row["error"] = f"{failed[0]['status']} in {len(failed)} of {len(runs)} rounds: {failed[0]['error']}"
        rows.append(row)
    return rows


def rows_by_round(runs: list[dict], strategies: list[str], rounds: int, reference: list[float] | None, cores: int,
                  clock: str, network: Network) -> list[list[dict]]:
    """Each round's rows, in the order of `strategies`, from the sweep's runs (dicts with round,
    strategy, world, status, error, seconds, summary): figures on the leading clock, the network's
    columns, and the ratios to each row's counterpart and to `single` from the same round."""
    per_round = []
    for k in range(rounds):
        mine = {r["strategy"]: r for r in runs if r["round"] == k}
        rows_k = []
        for strategy in strategies:
            r = mine[strategy]
            row = (row_from_summary(strategy, r["summary"], reference, r["seconds"], cores) if r["summary"] else
                   failed_row(strategy, r["world"], r["status"], r["error"], r["seconds"]))
            if r["summary"]:
                apply_clock(row, r["summary"], clock)
            row.update(net_columns(network, r["summary"]))
            row["round"] = k
            rows_k.append(row)
        add_baseline_ratios(rows_k)
        add_speedups(rows_k)
        per_round.append(rows_k)
    return per_round
