"""summary.json: the one output schema every strategy, every baseline and every tool shares.

Assembled here, in one place, by global rank 0 from every rank's report (`rank_report`, report/rank.py):
  config              the resolved Hydra config
  strategy            the strategy that ran ("single", "dp", "torch_ddp", ...)
  world_size          number of processes
  parallel            the layout (dp, tp, pp, microbatches, ...) and strategy options
  precision, device   fp32 | bf16 (train.precision); cpu | cuda
  losses              per step: mean loss over every token of the global batch
  step_time_s         the (lower) median over the timed steps (warm-up excluded) of the slowest rank's time
                      (host clock on the CPU, CUDA events on a GPU: parallel/dist/timing.py); for a
                      strategy that syncs once per `period_steps` P (DiLoCo's H), the mean over the last
                      whole periods of timed steps, so that the sync's step counts once in every P
  tokens_per_s        global tokens per step / step_time_s
  peak_memory_bytes   max over ranks (CUDA allocator on GPU, peak RSS on CPU); per rank in memory_by_rank;
                      peak_memory_scope says what it covers: on a GPU the timed steps (the allocator's
                      peak is reset after the warm-up), on the CPU the whole process
  comm                measured strategy traffic per optimizer step, summed over ranks:
                      sent_bytes_per_step, by_op / by_group / by_tag (calls, payload_bytes,
                      sent_bytes, seconds), by_tag_op (the same per tag and op: the per-layer
                      collective counts), by_rank, `tooling` (traffic the tools add, excluded: the
                      last step's, and `run`, every step's), and `outside_steps` (every call made
                      outside the steps: set-up, the loopback probe, checkpoints)
  expected_comm       the strategy's closed form (its family's theory.py) in the same fields
  comm_matches_theory the two sent_bytes_per_step equal exactly (Fractions, not floats); where theory
                      gives `period_steps` P (DiLoCo's H), the mean of the last P steps against it
  mfu                 model FLOPs utilisation (parallel/report/mfu.py): flops_per_token, peak_flops
                      (per device, measured or train.peak_flops), devices, mfu
  exposed_comm_measured  false where the strategy's waits happen inside PyTorch, out of the log's sight
                      (DDP's reducer; FSDP2's side streams on CUDA: time_breakdown's notes say which)
  memory              per rank: param_bytes, grad_bytes, optimizer_bytes held after the last step
                      and peak_model_state_bytes during it (tensor sizes), peak_allocator_bytes;
                      `formula` (the strategy's model_state formula, ZeRO paper) and `matches_formula`
  first_step          losses[i] is step first_step + i (non-zero when resumed)
  checkpoints         each save, each rank's record: wait, snapshot, write, publish and blocked seconds,
                      bytes written; each rank's timed steps plus its saves' blocking (reliability/saving.py)
  pipeline            pipelined strategies: schedule, measured / simulated / closed-form bubble
                      (null where none is claimed, and bubble_closed_form_note says "no closed
                      form" and why), executed order by rank (parallel/pp/timeline.py)
  moe                 mixture-of-experts models: tokens per expert per step, skew, dropped
                      assignments, routing.png; under expert parallelism the all-to-all bytes
                      measured against the exact figure from each step's routing
                      (parallel/moe/report.py)
  time_breakdown_s    where a step's time goes: {compute, exposed_comm, bubble, optimizer, other}
                      in seconds, mean over ranks of the median timed step (parallel/report/breakdown.py);
                      time_breakdown: that step, its detail (compute by phase, exposed comm by op
                      and group, other by phase) and notes on what could not be split;
                      time_breakdown_by_rank: the five per rank, with its coordinates
  trace               trace.json (every rank's last step, Perfetto) and timeline.png: the files and
                      their step (added by parallel/train.py; parallel/report/trace.py)
  virtual             the step as it would take with a device per rank (parallel/report/virtual.py,
                      parallel/replay/): step_time_s, tokens_per_s, mfu, time_breakdown_s (the same five,
                      mean) and time_breakdown_by_rank, what the step waits on, the link model, and
                      trace_virtual.json / timeline_virtual.png; events/ holds what it was replayed from
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import torch

from parallel.activations import activation_check_note
from parallel.algebra import parameter_count
from parallel.dist.comm import StepTraffic, Totals, summarize_traffic, traffic_by_tag_op
from parallel.registry import FAMILIES, describe
from parallel.reliability.saving import checkpoints_block
from parallel.report.breakdown import breakdown_notes, summarize_breakdown
from parallel.report.metrics import peak_memory_scope
from parallel.report.mfu import PEAK_DTYPES, devices_for_peak, flops_per_token, measure_peak_flops, mfu
from parallel.report.trace import write_run_trace
from parallel.report.virtual import virtual_block

SCHEMA_VERSION = 1


def build_summary(*, config: dict, plan, losses: list[float], rank_reports: list[dict], device: torch.device,
                  run_dir: Path, net: dict | None = None, links=None) -> dict:
    """The whole summary.json from the plan, the global losses and every rank's report."""
    timed_from = plan.warmup_steps
    # A step lasts as long as its slowest rank.
    step_times = [max(r["step_times"][i] for r in rank_reports) for i in range(len(losses))]
    # The lower median: one real step (with an even count the mean of two would be a step that never
    # ran), the same one whose time the breakdown splits (parallel/report/breakdown.py).
    step_time = statistics.median_low(step_times[timed_from:])
    expected = against_theory(plan, rank_reports, timed_from)
    period = int(expected["expected_comm"].get("period_steps", 1))
    if period > 1:  # a median step of a periodic strategy would leave out the step that syncs
        step_time = period_mean(step_times[timed_from:], period)
    summary = {
        "schema_version": SCHEMA_VERSION,
        "config": config,
        "strategy": plan.strategy,
        "world_size": plan.dims.world_size,
        "parallel": parallel_block(plan),
        **expected,
        "precision": plan.layout.precision,
        "device": plan.device_type,
        "steps": len(losses),
        "first_step": plan.start_step,
        "warmup_steps": plan.warmup_steps,
        "tokens_per_step": plan.tokens_per_step,
        "losses": losses,
        "step_times_s": step_times,
        "step_time_s": step_time,
        "tokens_per_s": plan.tokens_per_step / step_time,
    }
    summary["mfu"] = mfu_block(plan, device, summary["tokens_per_s"])
    # What each checkpoint cost each rank (parallel/reliability/saving.py).
    summary["checkpoints"] = checkpoints_block(rank_reports, plan.start_step, plan.warmup_steps)
    for family in FAMILIES:  # the blocks of their own (moe's routing, the pipeline's bubble)
        if family.report is not None:
            summary.update(family.report(plan, rank_reports, run_dir))
    rank_steps = [r["time_breakdown"] for r in rank_reports]
    notes = breakdown_notes([r["breakdown_note"] for r in rank_reports], plan.comm_log and plan.comm_time, rank_steps)
    summary.update(summarize_breakdown(rank_steps, step_times, timed_from, plan.start_step, notes))
    for row, r in zip(summary["time_breakdown_by_rank"] or [], rank_reports):
        row["coords"] = r["coords"]
    # The emulated network (launch.run): wire bytes per link class against the log's prediction; null otherwise.
    summary["net"] = net
    # The last step of every rank as trace.json (and timeline.png): drawn from the summary's own figures.
    summary["trace"] = write_run_trace(run_dir, rank_reports, summary, draw=plan.timeline)
    # The same steps replayed with a device per rank (a core per intra-op thread, parallel/replay/device.py;
    # links modelled).
    summary["virtual"] = virtual_block(plan, rank_reports, summary, run_dir, links)
    return summary


def parallel_block(plan) -> dict:
    """The layout: the dimensions, the microbatches, each family's options (null where the strategy
    does not honour them: parallel/family.py), the backend and the recomputation."""
    return {**plan.dims.as_dict(), "microbatches": plan.microbatches, "microbatch_size": plan.layout.microbatch_size,
            **describe(plan.layout, plan.spec), "backend": plan.backend, "recompute": plan.layout.recompute}


def against_theory(plan, rank_reports: list[dict], timed_from: int) -> dict:
    """What the run measured beside its closed forms: parameters, traffic, memory."""
    spec, layout = plan.spec, plan.layout
    # What the run measured that the closed forms need (a mixture of experts' routing sets expert
    # parallelism's all-to-all bytes: theory figures the last step's, as measured).
    for family in FAMILIES:
        if family.measured is not None:
            layout = family.measured(layout, rank_reports)
    expected = spec.comm(plan.model, layout)
    comm = summarize_comm([r["traffic"] for r in rank_reports], timed_from,
                          [r.get("traffic_outside") or {} for r in rank_reports])
    memory = [r["peak_memory_bytes"] for r in rank_reports]
    return {
        "model": {
            "parameters": rank_reports[0]["parameters"], "params_formula": parameter_count(plan.model),
            # What one rank holds (rank 0: a tensor-parallel shard, or a pipeline stage) and, where
            # theory has one, its closed form.
            "local_parameters": rank_reports[0]["local_parameters"],
            "local_params_formula": spec.local_parameters(plan.model, layout),
        },
        "peak_memory_bytes": max(memory),
        "memory_by_rank": memory,
        "peak_memory_scope": peak_memory_scope(plan.device_type),
        "comm": comm,
        "expected_comm": expected,
        "comm_matches_theory": (measured_bytes_per_step(comm, expected)
                                == Fraction(expected["sent_bytes_per_step_exact"])),
        # The registry's word for every device, and each rank's strategy's for this one (FSDP2 on CUDA).
        "exposed_comm_measured": spec.exposed_comm_measured and all(r.get("exposed_comm_measured", True)
                                                                    for r in rank_reports),
        "memory": summarize_memory(rank_reports, spec.model_state(plan.model, layout),
                                   spec.activations(plan.model, layout), activation_check_note(plan.device_type)),
    }


def period_mean(timed: list[float], period: int) -> float:
    """The mean step over the last whole periods of the timed steps (all of them if fewer than one
    period was timed): each period holds exactly one sync of every fragment."""
    whole = timed[len(timed) % period:] or timed
    return sum(whole) / len(whole)


def measured_bytes_per_step(comm: dict, expected: dict) -> Fraction:
    """The last step's bytes; for a strategy that syncs once per `period_steps` (DiLoCo's H), the
    mean of the last period's steps, which its closed form gives per step."""
    period = expected.get("period_steps", 1)
    if period == 1:
        return Fraction(comm["sent_bytes_per_step_exact"])
    return sum((Fraction(b) for b in comm["sent_bytes_by_step"][-period:]), Fraction(0)) / period


def mfu_block(plan, device: torch.device, tokens_per_s: float) -> dict:
    """MFU of the run against the peak of its device (measured here, after training, unless given).

    A quarter of a second of matmuls keeps every run cheap; launch.compare measures for longer,
    once, and passes the figure to each of its runs (train.peak_flops)."""
    # The peak of the dtype the matmuls run in: autocast's bf16 under train.precision=bf16.
    peak = plan.peak_flops or measure_peak_flops(device, min_seconds=0.25, dtype=PEAK_DTYPES[plan.layout.precision])
    devices = devices_for_peak(device, plan.dims.world_size)
    return {"mfu": mfu(plan.model, tokens_per_s, peak, devices), "flops_per_token": flops_per_token(plan.model),
            "peak_flops": peak, "peak_measured": plan.peak_flops is None, "peak_dtype": plan.layout.precision,
            "devices": devices}


def _totals_dict(groups: dict[str, Totals]) -> dict:
    return {k: v.as_dict() for k, v in sorted(groups.items())}


def _sum_over_ranks(traffics: list[StepTraffic]) -> StepTraffic:
    merged: StepTraffic = defaultdict(Totals)
    for traffic in traffics:
        for key, t in traffic.items():
            merged[key].add(t)
    return dict(merged)


def summarize_comm(rank_steps: list[list[StepTraffic]], timed_from: int,
                   rank_outside: list[StepTraffic] | None = None) -> dict:
    """Per-step traffic of every rank (and each rank's calls outside the steps) -> the summary's
    `comm` block.

    Per-step figures are taken from the last step (the steady state) and summed over ranks;
    `steady` says whether every step moved exactly the same bytes.
    """
    n_steps = len(rank_steps[0])
    per_step = [_sum_over_ranks([steps[i] for steps in rank_steps]) for i in range(n_steps)]
    strategy = [summarize_traffic(s) for s in per_step]
    whole_run = summarize_traffic(_sum_over_ranks(per_step))
    sent_by_step = [s["total"].sent_bytes for s in strategy]
    last = strategy[-1]
    tooling = summarize_traffic(per_step[-1], include_tooling=True)
    by_rank = [float(summarize_traffic(steps[-1])["total"].sent_bytes) for steps in rank_steps]
    timed = strategy[timed_from:] or strategy
    seconds_per_rank = [
        statistics.median(summarize_traffic(steps[i])["total"].seconds for i in range(timed_from, n_steps))
        if n_steps > timed_from else 0.0
        for steps in rank_steps
    ]
    return {
        "sent_bytes_per_step": float(sent_by_step[-1]),
        "sent_bytes_per_step_exact": str(sent_by_step[-1]),
        "payload_bytes_per_step": last["total"].payload_bytes,
        "calls_per_step": last["total"].calls,
        "steady": all(s == sent_by_step[-1] for s in sent_by_step),
        "sent_bytes_by_step": [float(s) for s in sent_by_step],
        "by_op": _totals_dict(last["by_op"]),
        "by_group": _totals_dict(last["by_group"]),
        "by_tag": _totals_dict(last["by_tag"]),
        "by_tag_op": {tag: _totals_dict(ops) for tag, ops in traffic_by_tag_op(per_step[-1]).items()},
        "by_rank": by_rank,
        # Time each rank was blocked in communication per step (median over timed steps, mean
        # over ranks): the communication that was *not* hidden behind computation. Host time on
        # the CPU; on a GPU, CUDA events on the stream that waited (comm.DeviceInterval).
        "exposed_seconds_per_step": statistics.fmean(seconds_per_rank),
        "timed_steps": len(timed),
        "tooling": {
            "sent_bytes_per_step": float(tooling["total"].sent_bytes),
            "by_tag": _totals_dict(tooling["by_tag"]),
            "run": _run_block(summarize_traffic(_sum_over_ranks(per_step), include_tooling=True)),
        },
        # Every call made outside the steps, all ranks, whatever its tag: set-up, the loopback probe
        # (parallel/replay/probe.py), checkpoints; up to the gathering of the reports this is built from.
        "outside_steps": _run_block(_outside(_sum_over_ranks(rank_outside or []))),
        # The same sums over every step of the run (warm-up included), all ranks.
        "run": {
            "steps": n_steps,
            "sent_bytes": float(whole_run["total"].sent_bytes),
            "by_op": _totals_dict(whole_run["by_op"]),
            "by_group": _totals_dict(whole_run["by_group"]),
            "by_tag": _totals_dict(whole_run["by_tag"]),
        },
    }


def _run_block(summary: dict) -> dict:
    return {"sent_bytes": float(summary["total"].sent_bytes), "by_tag": _totals_dict(summary["by_tag"])}


def _outside(traffic: StepTraffic) -> dict:
    """The total and by-tag sums of `traffic`, every tag (strategy and tooling) together."""
    total, by_tag = Totals(), defaultdict(Totals)
    for (_op, _group, tag), t in traffic.items():
        total.add(t)
        by_tag[tag].add(t)
    return {"total": total, "by_tag": by_tag}


MODEL_STATE_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def summarize_memory(rank_reports: list[dict], formula: dict | None,
                     activation_formula: list[int] | None = None, unchecked: str | None = None) -> dict:
    """The summary's `memory` block: per rank, the parameter, gradient and optimizer-state bytes
    it held after the last step, its peak model-state bytes during it (tensor sizes) and the bytes
    saved for backward at the last step's peak (parallel/report/activations.py), with the
    allocator's peak (CUDA on GPU, RSS on CPU); beside them the strategy's closed forms (`theory`:
    model_state_bytes, activation_bytes per rank) and whether every rank's model state equals its
    formula exactly. (`formula` is registry.model_state_bytes under its first name.) `unchecked`: why the
    activation formula cannot be held to this device's measurement (parallel/activations.py), or None."""
    by_rank = []
    for r in rank_reports:
        state = r["model_state"]
        by_rank.append({
            "rank": r["rank"],
            **{k: state[k] for k in MODEL_STATE_FIELDS},
            "total_bytes": sum(state[k] for k in MODEL_STATE_FIELDS),
            "peak_model_state_bytes": state["peak_model_state_bytes"],
            "activation_peak_bytes": r["activation_peak_bytes"],
            "peak_allocator_bytes": r["peak_memory_bytes"],
        })
    matches = None
    if formula is not None:
        matches = all(row[k] == formula[k] for row in by_rank for k in MODEL_STATE_FIELDS)
    measured = [row["activation_peak_bytes"] for row in by_rank]
    return {"by_rank": by_rank, "formula": formula, "matches_formula": matches,
            "activations_bytes_measured": measured,
            # Every rank's bytes saved for backward equal the registry's formula exactly (None: no formula,
            # or one that does not describe this device's kernels: `activations_check_note` says why).
            "activations_match_theory": (None if activation_formula is None or unchecked
                                         else measured == activation_formula),
            "activations_check_note": unchecked if activation_formula is not None else None,
            "theory": {"model_state_bytes": formula, "activation_bytes": activation_formula}}
