"""One row of the comparison per strategy, read from its run's summary.json.

A row is a flat dict (one CSV line). A strategy that failed or timed out still has a row: its
status and the error, every figure None.

Bytes are decimal everywhere in the comparison: MB = 10^6 bytes, traffic and memory alike.

Noise: `step_ms_min` and `step_ms_max` are the fastest and slowest timed step, `spread` their
difference over the median step, and `noisy` is true when the spread exceeds NOISY_SPREAD (25%):
then the row's tokens/s can move by that much from one run to the next, and differences smaller
than that between rows say nothing. With one timed step there is no spread (None).
"""

from __future__ import annotations

from parallel.report.summary import measured_bytes_per_step

COLUMNS = (
    "strategy", "runs_as", "schedule", "status", "layout", "world",
    "tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi",
    "baseline", "ratio_to_baseline", "ratio_lo", "ratio_hi", "step_ms", "step_ms_min", "step_ms_max", "spread", "noisy",
    "round", "rounds_ok", "oversubscribed", "tokens_per_step", "mfu",
    "compute_ms", "exposed_comm_ms", "bubble_ms", "optimizer_ms", "other_ms",
    "bytes_per_step", "bytes_per_step_theory", "matches_theory", "exposed_comm_share", "bubble_share",
    "peak_memory_mb_max", "peak_memory_mb_by_rank", "final_loss", "same_losses_as_single", "max_rel_loss_diff",
    "seconds", "error",
    # Which clock leads the row (parallel/compare/clock.py), and both clocks' figures side by side.
    "clock", "wall_tokens_per_s", "wall_step_ms", "wall_bubble_share", "virtual_tokens_per_s", "virtual_step_ms",
    # What a rank's virtual device was, and the speed-up over `single` on the leading clock, with why it
    # is withheld or above the row's ranks where it is (parallel/compare/speedup.py).
    "virtual_cores_per_rank", "virtual_compute_clock", "speedup_vs_single", "speedup_note",
    # The network the run was on (launch.compare net=..., compare.nets; parallel/compare/networks.py):
    # its settings, and per link class the bytes the interface counters saw, what the log predicts,
    # and how long the busiest link needs for them at its rate. "none": this machine's loopback.
    "network", "nodes", "procs_per_node", "placement", "inter_mbit", "intra_mbit",
    "inter_wire_bytes_per_step", "inter_logged_bytes_per_step", "inter_link_busy_ms",
    "intra_wire_bytes_per_step", "intra_logged_bytes_per_step", "intra_link_busy_ms",
)
NET_COLUMNS = COLUMNS[COLUMNS.index("network"):]
LOSS_RTOL = 1e-5  # the project's standard for "the same losses as the single-process run"
NOISY_SPREAD = 0.25  # (slowest - fastest timed step) / median step above this: the row is flagged noisy
MB = 1e6  # decimal megabytes, for traffic and memory alike
BREAKDOWN_COLUMNS = {"compute": "compute_ms", "exposed_comm": "exposed_comm_ms", "bubble": "bubble_ms",
                     "optimizer": "optimizer_ms", "other": "other_ms"}


def layout(summary: dict) -> str:
    """dp x tp x pp, then microbatches (and virtual stages for interleaved pipelines, expert parallelism,
    context parallelism's degree and kind, recomputation)."""
    p = summary["parallel"]
    text = f"{p['dp']}x{p['tp']}x{p['pp']} m{p['microbatches']}"
    if p.get("cp", 1) > 1:
        text += f" cp{p['cp']} {p['cp_kind']}"
    if p.get("recompute", "none") != "none":
        text += f" rc-{p['recompute']}"
    if p.get("virtual_stages") and p["virtual_stages"] > 1:
        text += f" v{p['virtual_stages']}"
    if p.get("sequence_parallel"):
        text += " sp"
    if p.get("ep", 1) > 1:
        text += f" ep{p['ep']}"  # experts over ep of the dp ranks
    return text


def max_rel_diff(losses: list[float], reference: list[float]) -> float | None:
    if len(losses) != len(reference):
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def failed_row(strategy: str, world: int, status: str, error: str, seconds: float) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(strategy=strategy, status=status, world=world, error=error, seconds=round(seconds, 1))
    return row


def step_spread(summary: dict) -> dict:
    """The timed steps' fastest and slowest (ms), their spread over the median, and the noisy flag."""
    timed = summary["step_times_s"][summary["warmup_steps"]:]
    fastest, slowest, median = min(timed) * 1e3, max(timed) * 1e3, summary["step_time_s"] * 1e3
    spread = (slowest - fastest) / median if len(timed) > 1 else None
    return {"step_ms_min": fastest, "step_ms_max": slowest, "spread": spread,
            "noisy": None if spread is None else spread > NOISY_SPREAD}


def row_from_summary(strategy: str, summary: dict, reference_losses: list[float] | None, seconds: float,
                     cores: int | None = None) -> dict:
    """`cores`: what this machine gives the ranks (CPU cores, or GPUs); a row with more ranks than
    that is `oversubscribed` (ranks take turns on a core: their time includes waiting for one)."""
    comm, expected = summary["comm"], summary["expected_comm"]
    step = summary["step_time_s"]  # a periodic strategy's (DiLoCo's): the mean over whole periods (report/summary.py)
    exposed = comm["exposed_seconds_per_step"] / step if summary.get("exposed_comm_measured", True) else None
    pipeline = summary.get("pipeline")
    memory = [m / MB for m in summary["memory_by_rank"]]
    breakdown = summary.get("time_breakdown_s") or {}
    diff = max_rel_diff(summary["losses"], reference_losses) if reference_losses is not None else None
    row = dict.fromkeys(COLUMNS)
    row.update(
        strategy=strategy,
        runs_as=summary["strategy"],
        schedule=summary["parallel"].get("schedule"),
        status="ok",
        layout=layout(summary),
        world=summary["world_size"],
        tokens_per_s=summary["tokens_per_s"],
        tokens_per_step=summary["tokens_per_step"],
        step_ms=step * 1e3,
        **step_spread(summary),
        round=0,
        rounds_ok=1,
        oversubscribed=None if cores is None else summary["world_size"] > cores,
        **{column: breakdown[part] * 1e3 if part in breakdown else None for part, column in BREAKDOWN_COLUMNS.items()},
        mfu=summary.get("mfu", {}).get("mfu"),
        # a periodic strategy's (DiLoCo's): the mean of its last period, as its closed form counts it
        bytes_per_step=(float(measured_bytes_per_step(comm, expected)) if expected.get("period_steps", 1) > 1
                        else comm["sent_bytes_per_step"]),
        bytes_per_step_theory=expected["sent_bytes_per_step"],
        matches_theory=summary["comm_matches_theory"],
        exposed_comm_share=exposed,
        bubble_share=pipeline["bubble_measured"] if pipeline else None,
        peak_memory_mb_max=max(memory),
        peak_memory_mb_by_rank=[round(m, 1) for m in memory],
        final_loss=summary["losses"][-1],
        same_losses_as_single=None if diff is None else diff <= LOSS_RTOL,
        max_rel_loss_diff=diff,
        seconds=round(seconds, 1),
        error="",
    )
    return row


def add_baseline_ratios(rows: list[dict]) -> None:
    """ratio_to_baseline = this row's tokens/s over its PyTorch counterpart's (> 1: ours is faster).

    The counterpart is the registry's (`StrategySpec.counterpart`: dp against DDP, zero1 against
    DDP + ZeroRedundancyOptimizer, zero2 against FSDP2 without resharding, zero3 against FSDP2, tp
    against DTensor, a pipeline schedule against torch's same schedule),
    found among the rows that ran: the first with that strategy and the same schedule."""
    from parallel.registry import spec_of

    ran = [r for r in rows if r["status"] == "ok"]
    for row in ran:
        counterpart = spec_of(row["runs_as"]).counterpart
        theirs = next((r for r in ran if r["runs_as"] == counterpart and r["schedule"] == row["schedule"]), None)
        if theirs is None:
            continue
        row["baseline"] = theirs["strategy"]
        if row["tokens_per_s"] and theirs["tokens_per_s"]:
            row["ratio_to_baseline"] = row["tokens_per_s"] / theirs["tokens_per_s"]
