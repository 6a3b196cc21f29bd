"""Predictions against runs: run a layout, read its summary.json, add measured columns and errors.

A layout runs as a user would run it: `python -m launch.run net=<preset> <overrides>` on emulated
nodes, plain `torchrun --standalone` for net=none (one node, loopback). The overrides are the row's
`run_overrides` (every layout field explicit),
the model preset, the validation's steps and the planner's peak FLOP/s (so the run's MFU and the
prediction's use one peak). The run's summary.json gives what is compared:

    step_time_s          summary step_time_s (median of the timed steps, slowest rank); for a strategy
                         that syncs once per H steps (DiLoCo), the mean over whole periods (`per_step`)
    virtual_step_time_s  summary virtual.step_time_s: the same steps replayed with a device per rank
                         (parallel/replay/), the figure a prediction that gives each rank its own
                         compute should be compared with where ranks outnumber the cores
    virtual_exposed_comm_s, virtual_bubble_fraction  the replay's exposed communication (mean over
                         ranks) and its bubble share of the step
    exposed_comm_s       comm.exposed_seconds_per_step (mean over ranks)
    bubble_fraction      pipeline.bubble_measured (pipelines: idle share of rank-time)
    bytes                comm.sent_bytes_per_step (all ranks, the log's count; DiLoCo: its last period's
                         mean) against the row's intra + inter bytes (theory's); equal or not, exactly
    inter_node_bytes     where the run was on emulated nodes: the net block's logged and wire counts
    activations          memory.activations_bytes_measured (per rank, the saved-tensor meter) against
                         the row's formula per rank: the largest relative difference
    model state          memory.by_rank totals against the row's params + grads + optimizer

Calibration: with plan.calibrate, a one-process run of the model (`parallel=single`) comes first;
its MFU over its step less the optimizer phase (which the planner times on its own) is the share of the
peak this machine's matmuls reach on this model, and becomes the cluster's efficiency for every prediction
that follows.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

from parallel.planner.report import layout_label
from parallel.report.summary import measured_bytes_per_step


class ValidationError(RuntimeError):
    """A validation that cannot run (its calibration run failed)."""


def launch_command(overrides: list[str], world: int, net: dict | None, net_preset: str | None) -> list[str]:
    """The command line that runs one layout on the network `net` (None or net=none: loopback)."""
    emulated = net is not None and (int(net.get("nodes") or 1) > 1 or net.get("inter_mbit") or net.get("intra_mbit")
                                    or net.get("latency_ms") or net.get("loss_pct"))
    if emulated or net_preset not in (None, "none"):
        net_overrides = [f"net={net_preset or 'none'}"] + [f"net.{k}={'null' if v is None else v}"
                                                          for k, v in (net or {}).items()]
        return [sys.executable, "-m", "launch.run", *net_overrides, *overrides]
    if world == 1:
        return [sys.executable, "-m", "launch.train", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "launch.train", *overrides]


def run_layout(overrides: list[str], world: int, run_dir: Path, net: dict | None, net_preset: str | None,
               timeout_s: float) -> dict:
    """Run it (launch.compare's runner: own session, stopped with its children on timeout) and return
    its summary, or {"error": ...}."""
    from parallel.runner import run_one

    cmd = launch_command([*overrides, f"run.dir={run_dir}"], world, net, net_preset)
    status, error, seconds = run_one(cmd, run_dir, timeout_s)
    if status != "ok":
        return {"error": error, "command": " ".join(cmd)}
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["_command"] = " ".join(cmd)
    summary["_wall_s"] = seconds
    return summary


def _rel(predicted, measured) -> float | None:
    if predicted is None or measured in (None, 0):
        return None
    return (predicted - measured) / measured


def measured_columns(row: dict, summary: dict) -> tuple[dict, dict]:
    """(measured, errors) for one row from its run's summary.json."""
    memory = summary["memory"]
    # A run whose kernels the activation formula does not describe (CUDA's attention kernels save
    # other tensors: the summary's activations_check_note) is not a measurement of the formula.
    acts = None if memory.get("activations_check_note") else memory.get("activations_bytes_measured")
    state = [r["total_bytes"] for r in memory["by_rank"]]
    pipeline = summary.get("pipeline") or {}
    net = summary.get("net") or {}
    step_time, sent = per_step(summary)
    measured = {
        "step_time_s": step_time,
        **_virtual(summary),
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"]["mfu"],
        "exposed_comm_s": summary["comm"]["exposed_seconds_per_step"],
        "bubble_fraction": pipeline.get("bubble_measured"),
        "sent_bytes_per_step": float(sent),
        "sent_bytes_per_step_exact": str(sent),
        "inter_node_logged_bytes": net.get("logged_inter_bytes_per_step"),
        "inter_node_wire_bytes": net.get("wire_inter_bytes_per_step"),
        "activation_bytes_by_rank": acts,
        "model_state_bytes_max": max(state),
        "command": summary.get("_command"),
    }
    predicted_bytes = (row["bytes_per_step"]["intra_node"] + row["bytes_per_step"]["inter_node"]
                       if row["bytes_per_step"] else None)
    stages, world = row["layout"]["pp"], summary["world_size"]
    formula = [row["memory_by_stage"][rank // (world // stages)]["activations"] for rank in range(world)]
    if any(f is None for f in formula):
        formula = None
    states = [sum(m[k] for k in ("params", "grads", "optimizer")) if m["params"] is not None else None
              for m in row["memory_by_stage"]]
    t = row["step_time_s"]
    errors = {
        "step_time": _rel(t["total"] if t else None, measured["step_time_s"]),
        "virtual_step_time": _rel(t["total"] if t else None, measured["virtual_step_time_s"]),
        "virtual_exposed_comm": _rel(t["exposed_comm"] if t else None, measured["virtual_exposed_comm_s"]),
        "exposed_comm": _rel(t["exposed_comm"] if t else None, measured["exposed_comm_s"]),
        "bubble_fraction": (t["bubble"] / t["total"] - measured["bubble_fraction"])
        if t and measured["bubble_fraction"] is not None else None,
        "bytes_equal": predicted_bytes is not None and Fraction(row["bytes_exact"]) == sent,
        "bytes": _rel(predicted_bytes, measured["sent_bytes_per_step"]),
        "inter_node_bytes": _rel(row["bytes_per_step"]["inter_node"] if row["bytes_per_step"] else None,
                                 measured["inter_node_logged_bytes"]),
        "activations": max((abs(_rel(f, m)) for f, m in zip(formula, acts) if m), default=None)
        if formula and acts else None,
        "model_state": _rel(max(states), measured["model_state_bytes_max"]) if None not in states else None,
    }
    return measured, errors


def _virtual(summary: dict) -> dict:
    """The replay's figures of the run (None where it has no virtual block)."""
    v = summary.get("virtual") or {}
    if "step_time_s" not in v:
        return {"virtual_step_time_s": None, "virtual_exposed_comm_s": None, "virtual_bubble_fraction": None}
    parts = v["time_breakdown_s"]
    return {"virtual_step_time_s": v["step_time_s"], "virtual_exposed_comm_s": parts["exposed_comm"],
            "virtual_bubble_fraction": parts["bubble"] / v["step_time_s"] if v["step_time_s"] else None}


def per_step(summary: dict) -> tuple[float, Fraction]:
    """The run's step time and bytes per step, as the row predicts them: summary.json's step (for a
    strategy that syncs once per period, DiLoCo's H, the mean over whole periods: the sync steps
    included, as the prediction spreads one sync over H steps) and the last step's bytes, or the last
    period's mean bytes, exactly."""
    return summary["step_time_s"], measured_bytes_per_step(summary["comm"], summary.get("expected_comm") or {})


def order_agreement(rows: list[dict]) -> dict:
    """Whether the measured order of the validated layouts (fastest first) is the predicted one."""
    done = [r for r in rows if r.get("measured")]
    predicted = [r["rank"] for r in sorted(done, key=lambda r: r["step_time_s"]["total"])]
    measured = [r["rank"] for r in sorted(done, key=lambda r: r["measured"]["step_time_s"])]
    return {"predicted_order": predicted, "measured_order": measured, "same": predicted == measured}


def choose(rows: list[dict], top: int, names: list[str] | None) -> list[dict]:
    """The best `top` layouts that fit, and for each name given (a preset or a strategy) its best
    fitting layout, in rank order."""
    fitting = [r for r in rows if r["fits"] and r["step_time_s"]]
    chosen = fitting[:top]
    for name in names or []:
        best = next((r for r in fitting if name in (r["layout"]["preset"], r["layout"]["strategy"])), None)
        if best is not None and best not in chosen:
            chosen.append(best)
    return sorted(chosen, key=lambda r: r["rank"])


def run_settings(model_overrides: list[str], steps: int, warmup_steps: int, peak_flops: float) -> list[str]:
    """What every validation run shares: the model, its length, and the planner's peak for MFU."""
    return [*model_overrides, f"train.steps={steps}", f"train.warmup_steps={warmup_steps}",
            f"train.peak_flops={peak_flops}"]


def calibrate(settings: list[str], global_batch: int, world: int, run_root: Path,
              timeout_s: float, name: str = "calibration-single") -> tuple[float, dict]:
    """Efficiency from a one-process run of the model (nothing but compute and its optimizer step), run with the
    threads each rank of a `world`-rank run gets (train.py: cores // ranks, at least 1): its FLOP/s
    over the peak of those threads' cores. (Two threads on a loaded 2-core machine can run slower
    than one; measuring another thread count than the runs use would calibrate something else.)"""
    from parallel.report.mfu import usable_cores

    cores = usable_cores()
    threads = max(1, cores // world)
    overrides = ["parallel=single", *settings, f"train.global_batch={global_batch}", f"train.threads={threads}"]
    summary = run_layout(overrides, 1, run_root / name, None, None, timeout_s)
    if "error" in summary:
        raise ValidationError(f"the calibration run (parallel=single) failed: {summary['error']}")
    # The planner times the optimizer step on its own (optimizer_step.py): the matmuls' share of the peak is
    # the step's FLOPs over the step less its optimizer phase.
    step, optimizer = summary["step_time_s"], summary["time_breakdown_s"]["optimizer"]
    return min(1.0, summary["mfu"]["mfu"] * cores / threads * step / (step - optimizer)), summary


def validate_rows(chosen: list[dict], settings: list[str], world: int, run_root: Path, net: dict | None,
                  net_preset: str | None, timeout_s: float, progress=print, recalibrate=None) -> None:
    """Run every chosen row; each gets `measured` and `errors` (or `measured_error`). `recalibrate`
    (plan.calibrate=each): (row, name) -> the row predicted anew from a calibration run made right
    before this one, so that a machine whose load changes from minute to minute is measured twice
    under the same load."""
    for i, row in enumerate(chosen, 1):
        name = f"{row['rank']:03d}-{row['layout']['preset'] or row['layout']['strategy']}"
        progress(f"validating {i}/{len(chosen)}: {name} {layout_label(row['layout'])}")
        if recalibrate is not None:
            row.update(recalibrate(row, name))
        summary = run_layout([*row["run_overrides"], *settings], world, run_root / name, net, net_preset, timeout_s)
        if "error" in summary:
            row["measured_error"] = summary["error"]
            continue
        row["measured"], row["errors"] = measured_columns(row, summary)
