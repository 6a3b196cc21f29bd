"""The one training loop, for every strategy.

    plan (validated)  ->  corpus  ->  process groups  ->  model from the seed  ->  strategy
    for each step: global batch -> this rank's microbatches -> strategy.train_step -> loss on rank 0
    at the end: every rank's timings, traffic and memory gathered to rank 0 -> summary.json
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from . import theory
from .checkpoint import checkpoint_meta, load_checkpoint, save_checkpoint
from .comm import CommFailure, CommLog, calls_by_tag_op, summarize_traffic
from .data import GlobalBatches, load_corpus, local_microbatches
from .faults import gone_peers, inject_before_step, kill_during_save, peer_table
from .distributed import DistContext, LaunchEnv, init_distributed, shutdown, threads_per_rank
from .metrics import (
    MetricsWriter,
    build_summary,
    close_logging,
    default_run_dir,
    peak_memory_bytes,
    setup_logging,
    summarize_memory,
    write_json,
)
from .mesh3d import Mesh3D
from .model import GPT, count_parameters
from .mfu import devices_for_peak, flops_per_token, measure_peak_flops, mfu
from .native import AccelerateDDP, TorchDDP, TorchFSDP2
from .native_pp import TorchPipeline
from .native_tp import TorchTP
from .net.probe import WireProbe
from .plan import ConfigError, RunPlan
from .precision import ForwardContext
from .strategy import NonFiniteLoss, SingleProcess, Strategy, make_optimizer
from .dp import DataParallel
from .pp.executor import PipelineParallel
from .pp.timeline import write_pipeline_report
from .timing import StepTimer
from .tp_strategy import TensorParallel
from .zero import ZeroDataParallel
from .zero3 import Zero3

log = logging.getLogger("parallel")


class TrainingStopped(RuntimeError):
    """The run stopped on purpose, on every rank (a non-finite loss); the message says why."""


def build_strategy(plan: RunPlan, ctx: DistContext) -> Strategy:
    """The one model, built from the seed on every rank, then wrapped by the strategy."""
    model = GPT(plan.model, seed=plan.seed).to(ctx.device)

    def optimizer_for(m):
        return make_optimizer(m, plan.lr, plan.weight_decay)

    if plan.strategy == "single":
        return SingleProcess(model, optimizer_for(model))
    if plan.strategy == "dp":
        return DataParallel(model, optimizer_for(model), ctx.comm("dp"), plan.grad_sync, plan.bucket_mb)
    if plan.strategy == "torch_ddp":
        return TorchDDP(model, optimizer_for, ctx.comm("dp"), plan.bucket_mb)
    if plan.strategy == "pp":
        return PipelineParallel(
            model, pp_comm=ctx.comm("pp"), dp_comm=ctx.comm("dp"), schedule=plan.schedule,
            microbatches=plan.microbatches, virtual=plan.virtual_stages,
            pp_layers=list(plan.pp_layers) if plan.pp_layers else None, lr=plan.lr, weight_decay=plan.weight_decay,
        )
    if plan.strategy == "tp":
        return TensorParallel(model, optimizer_for, ctx.comm("tp"), ctx.comm("dp"), plan.sequence_parallel,
                              plan.grad_sync, plan.bucket_mb)
    if plan.strategy == "accelerate_ddp":
        return AccelerateDDP(model, optimizer_for, ctx.comm("dp"), plan.bucket_mb, ctx.device)
    if plan.strategy == "torch_tp":
        return TorchTP(model, optimizer_for, ctx.mesh["tp"], ctx.comm("tp"), ctx.comm("dp"), ctx.log)
    if plan.strategy == "torch_pp":
        return TorchPipeline(model, plan.schedule, ctx.comm("pp"), plan.microbatches, plan.virtual_stages,
                             list(plan.pp_layers) if plan.pp_layers else None, plan.lr, plan.weight_decay, ctx.device, ctx.log)
    if plan.strategy == "3d":
        return Mesh3D(
            model, tp_comm=ctx.comm("tp"), pp_comm=ctx.comm("pp"), dp_comm=ctx.comm("dp"),
            sequence_parallel=plan.sequence_parallel, grad_sync=plan.grad_sync, bucket_mb=plan.bucket_mb,
            schedule=plan.schedule, microbatches=plan.microbatches, virtual=plan.virtual_stages,
            pp_layers=list(plan.pp_layers) if plan.pp_layers else None, lr=plan.lr, weight_decay=plan.weight_decay,
            zero=plan.zero,
        )
    if plan.strategy in ("zero1", "zero2"):
        return ZeroDataParallel(model, ctx.comm("dp"), int(plan.strategy[-1]), plan.lr, plan.weight_decay)
    if plan.strategy == "zero3":
        return Zero3(model, ctx.comm("dp"), plan.lr, plan.weight_decay)
    if plan.strategy == "torch_fsdp2":
        return TorchFSDP2(model, ctx.mesh["dp"], ctx.comm("dp"), plan.lr, plan.weight_decay)
    raise AssertionError(f"unhandled strategy {plan.strategy}")  # plan.py refuses unknown names


def _resolve_run_dir(plan: RunPlan, ctx: DistContext) -> Path:
    """Rank 0 names the run directory and tells the others, so all ranks write to one place."""
    run_dir = plan.run_dir or default_run_dir(plan.strategy, plan.dims.world_size)
    world = ctx.comm("world")
    if world is not None:
        run_dir = world.broadcast_object(run_dir, 0, tag="tooling/run_dir")
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_forward_context(plan: RunPlan, strategy: Strategy) -> None:
    """Every rank runs a forward pass each step, so every rank reaches the same verdict here."""
    if plan.precision != "fp32" and strategy.forward_context.entered == 0:
        raise ConfigError(
            f"train.precision={plan.precision} is not implemented by parallel={plan.strategy}: its train_step runs the "
            "forward pass outside Strategy.forward_context, so it would train in fp32; use train.precision=fp32"
        )


def _console_line(step: int, plan: RunPlan, loss: float, seconds: float, sent_bytes: float) -> str:
    timing = "warm-up" if step - plan.start_step < plan.warmup_steps else f"{plan.tokens_per_step / seconds:9.0f} tok/s"
    return (
        f"step {step:4d} | loss {loss:.4f} | {seconds * 1e3:8.1f} ms | {timing} | "
        f"{sent_bytes / 1e6:8.3f} MB sent by rank 0"
    )


def train(plan: RunPlan, resolved_config: dict, env: LaunchEnv) -> Path:
    """Run the plan; returns the run directory (summary.json is in it on rank 0)."""
    torch.set_num_threads(threads_per_rank(env.local_world_size, plan.threads))
    corpus = load_corpus(plan.data_path, plan.data_max_bytes, plan.model.seq_len + 1)  # before any group
    comm_log = CommLog(enabled=plan.comm_log, timed=plan.comm_time)
    ctx = init_distributed(env, plan.dims, plan.backend, plan.timeout_s, comm_log, plan.device_type)
    try:
        run_dir = _train(plan, resolved_config, ctx, corpus)
    except RuntimeError as e:
        # A call failed (ours name themselves: CommFailure; DDP's reducer raises plain
        # RuntimeErrors): if a peer on this machine is gone, the message will name it.
        if len(ctx.peers) > 1 and (isinstance(e, CommFailure) or "Connection" in str(e)):
            e.gone_peers = gone_peers(ctx.peers, ctx.rank)
        raise
    finally:
        close_logging()
    # Only after success: a rank that failed must not wait in a barrier for peers that may be
    # stuck in a collective waiting for it; it exits and torchrun stops the others.
    shutdown(ctx)
    return run_dir


def _train(plan: RunPlan, resolved_config: dict, ctx: DistContext, corpus: torch.Tensor) -> Path:
    run_dir = _resolve_run_dir(plan, ctx)
    setup_logging(run_dir, ctx.rank)
    ctx.peers = peer_table(ctx.comm("world"))
    log.info(
        "run %s | strategy %s | world %d = dp %d x tp %d x pp %d | backend %s | device %s | precision %s | rank %d pid %d",
        run_dir, plan.strategy, plan.dims.world_size, plan.dims.dp, plan.dims.tp, plan.dims.pp,
        plan.backend or "none", ctx.device, plan.precision, ctx.rank, os.getpid(),
    )
    # Where this process runs (torchrun's GROUP_RANK is the node's rank): the per-rank logs show the layout.
    logging.getLogger("parallel.rank").info(
        "rank %d | node %s | local rank %d of %d | coords %s", ctx.rank, os.environ.get("GROUP_RANK", "0"),
        ctx.env.local_rank, ctx.env.local_world_size, ctx.coords,
    )
    layout_warning = plan.dims.node_layout_warning(ctx.env.local_world_size)
    if layout_warning and ctx.is_rank0:
        log.warning("warning: %s", layout_warning)
    strategy = build_strategy(plan, ctx)
    strategy.forward_context = ForwardContext(plan.precision, ctx.device)
    strategy.finite_comm, strategy.check_finite = ctx.comm("world"), plan.check_finite
    if plan.resume_from:
        model_state, optim_state = load_checkpoint(Path(plan.resume_from))
        strategy.load_full_state(model_state, optim_state)
        del model_state, optim_state
        log.info("resumed from %s: continuing at step %d", plan.resume_from, plan.start_step)
    checkpoint_root = Path(plan.checkpoint_dir) if plan.checkpoint_dir else run_dir / "checkpoints"
    n_params, n_local = strategy.full_parameter_count(), count_parameters(strategy.model)
    log.info("model: %d parameters (%d on this rank) | %d tokens per step | %d microbatch(es) of %d sequences per rank",
             n_params, n_local, plan.tokens_per_step, plan.microbatches, plan.microbatch_size)

    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    dp_rank = ctx.coords["dp"]
    metrics = MetricsWriter(run_dir / "metrics.jsonl") if ctx.is_rank0 else None
    losses, step_times = [], []
    timer = StepTimer(ctx.device)  # CUDA events on a GPU, the host clock on the CPU
    wire = WireProbe.from_environ(ctx, plan.start_step + plan.warmup_steps)  # emulated networks (launch.run) only
    for step in wire.steps(range(plan.start_step, plan.steps)):
        global_batch = batches(step)
        microbatches = [mb.to(ctx.device) for mb in local_microbatches(global_batch, dp_rank, plan.dims.dp, plan.microbatches)]
        inject_before_step(plan.fail_mode, plan.fail_at_step, plan.fail_rank, step, ctx.rank, strategy.model.parameters())
        ctx.log.begin_step()
        timer.start()
        guarded = strategy.finite_checks
        try:
            local_loss = strategy.train_step(microbatches, global_batch.n_tokens)
        except NonFiniteLoss as e:
            # Every rank gets here at the same step (the flag was all-reduced): say it in every
            # rank's log, then stop with the weights and moments of the last good step.
            message = (f"non-finite loss at step {step} ({e}): stopped before the optimizer step, weights unchanged; "
                       "lower train.lr, or resume from the last checkpoint")
            log.error("error: %s", message)
            raise TrainingStopped(message) from None
        if strategy.finite_checks != guarded + 1:
            raise AssertionError(f"strategy {plan.strategy} ran its optimizer step without guard_finite(local_loss) "
                                 "(parallel/strategy.py): call it once per step, before optimizer.step()")
        seconds = timer.stop()
        if step == plan.start_step:
            _check_forward_context(plan, strategy)
        loss = strategy.global_loss(local_loss)  # tooling traffic, outside the timed region
        traffic = ctx.log.end_step()
        if plan.save_grads and step == 0:
            # The optimizer step leaves .grad alone: these are the synced gradients it used.
            grads = strategy.full_grads()
            if ctx.is_rank0:
                torch.save(grads, run_dir / "grads_step0.pt")
        losses.append(loss)
        step_times.append(seconds)
        if metrics is not None:
            sent = float(summarize_traffic(traffic)["total"].sent_bytes)
            metrics.write({
                "step": step, "loss": loss, "step_time_s": seconds, "warmup": step - plan.start_step < plan.warmup_steps,
                "tokens_per_s": plan.tokens_per_step / seconds, "rank0_sent_bytes": sent,
                "data_checksum": global_batch.checksum(),
                "rank0_calls": calls_by_tag_op(traffic),
            })
            log.info(_console_line(step, plan, loss, seconds, sent))
        if plan.checkpoint_every and (step + 1) % plan.checkpoint_every == 0:
            _save_checkpoint(plan, ctx, strategy, checkpoint_root, step + 1)
    strategy.close()
    if metrics is not None:
        metrics.close()

    report = {
        "rank": ctx.rank,
        "coords": ctx.coords,
        "pipeline_spans": getattr(strategy, "spans", None),
        "pipeline_executed": [str(a) for a in getattr(strategy, "executed", [])],
        "parameters": n_params,
        "local_parameters": n_local,
        "step_times": step_times,
        "traffic": ctx.log.steps,
        "peak_memory_bytes": peak_memory_bytes(ctx.device),
        # Parameters, gradients and optimizer state this rank holds after the last step, and its
        # peak during that step, from tensor sizes.
        "model_state": strategy.memory_report(),
        "net": wire.report(),
    }
    world = ctx.comm("world")
    reports = world.gather_object(report, 0, tag="tooling/summary") if world is not None else [report]
    if plan.save_final:
        state = strategy.full_state_dict()
        if ctx.is_rank0:
            torch.save(state, run_dir / "final_model.pt")
    if ctx.is_rank0:
        expected = {
            "comm": theory.expected_comm(plan.strategy, plan.model, plan.dims, microbatch_size=plan.microbatch_size,
                                         microbatches=plan.microbatches, virtual=plan.virtual_stages,
                                         sequence_parallel=plan.sequence_parallel, pp_layers=plan.pp_layers,
                                         zero=plan.zero),
            "parameters": theory.parameter_count(plan.model),
            "local_parameters": _local_params_formula(plan),
        }
        summary = build_summary(config=resolved_config, plan=plan, losses=losses, rank_reports=reports, expected=expected)
        summary["memory"] = summarize_memory(reports, theory.model_state_bytes(
            plan.strategy, plan.model, plan.dims, zero=plan.zero, virtual=plan.virtual_stages, pp_layers=plan.pp_layers))
        summary["first_step"] = plan.start_step  # losses[i] is step first_step + i (non-zero when resumed)
        summary["mfu"] = _mfu_block(plan, ctx.device, summary["tokens_per_s"])
        summary["exposed_comm_measured"] = getattr(strategy, "exposed_comm_measured", True)
        summary["net"] = wire.summary(reports, plan.warmup_steps)  # None unless launched by launch.run
        if plan.strategy in ("pp", "3d"):
            # The first pipeline (dp 0): its ranks' spans of the last step, in stage order.
            spans = [r["pipeline_spans"] for r in sorted(reports, key=lambda r: r["coords"]["pp"])
                     if r["coords"]["dp"] == 0 and r["coords"]["tp"] == 0]
            summary["pipeline"] = write_pipeline_report(run_dir, spans, plan.schedule, plan.dims.pp,
                                                        plan.microbatches, plan.virtual_stages)
            summary["pipeline"]["executed_by_rank"] = [r["pipeline_executed"] for r in reports]
        write_json(run_dir / "summary.json", summary)
        _log_summary(summary)
        log.info("wrote %s", run_dir / "summary.json")
    return run_dir


def _mfu_block(plan: RunPlan, device: torch.device, tokens_per_s: float) -> dict:
    """MFU of the run against the peak of its device (measured here, after training, unless given).

    A quarter of a second of matmuls keeps every run cheap; launch.compare measures for longer,
    once, and passes the figure to each of its runs (train.peak_flops)."""
    peak = plan.peak_flops or measure_peak_flops(device, min_seconds=0.25)
    devices = devices_for_peak(device, plan.dims.world_size)
    return {"mfu": mfu(plan.model, tokens_per_s, peak, devices), "flops_per_token": flops_per_token(plan.model),
            "peak_flops": peak, "peak_measured": plan.peak_flops is None, "devices": devices}


def _local_params_formula(plan: RunPlan) -> int | None:
    """What rank 0 holds, in closed form where theory has one."""
    if plan.strategy in ("pp", "torch_pp"):
        return None
    if plan.strategy == "3d":
        return theory.mesh3d_local_parameter_count(plan.model, plan.dims, plan.virtual_stages, plan.pp_layers)
    return theory.tp_shard_parameter_count(plan.model, plan.dims.tp)


def _save_checkpoint(plan: RunPlan, ctx: DistContext, strategy: Strategy, root: Path, steps_done: int) -> None:
    """Gather the whole state to rank 0 (collective, every rank) and let rank 0 write it."""
    start = time.perf_counter()
    model_state = strategy.full_state_dict()
    optim_state = strategy.full_optimizer_state()
    if ctx.is_rank0:
        path = save_checkpoint(root, steps_done, model_state, optim_state, checkpoint_meta(plan, steps_done),
                               before_rename=kill_during_save(plan.fail_mode, plan.fail_at_step, steps_done))
        log.info("checkpoint %s (%.2f s)", path, time.perf_counter() - start)


def _log_summary(summary: dict) -> None:
    comm, expected = summary["comm"], summary["expected_comm"]
    log.info(
        "done: %d steps | final loss %.4f | median step %.1f ms | %.0f tokens/s | peak memory %.1f MB",
        summary["steps"], summary["losses"][-1], summary["step_time_s"] * 1e3, summary["tokens_per_s"],
        summary["peak_memory_bytes"] / 1e6,
    )
    log.info("MFU %.1f%% (%.3g FLOP/token, peak %.3g FLOP/s x %d device(s))", 100 * summary["mfu"]["mfu"],
             summary["mfu"]["flops_per_token"], summary["mfu"]["peak_flops"], summary["mfu"]["devices"])
    memory = summary["memory"]
    log.info("model state per rank (params + grads + optimizer, bytes): measured %s | formula %s",
             [r["total_bytes"] for r in memory["by_rank"]],
             memory["formula"]["total_bytes"] if memory["formula"] else "none for this layout")
    if "pipeline" in summary:
        pipe = summary["pipeline"]
        log.info("pipeline %s: bubble measured %.1f%% | simulated %.1f%% | closed form %.1f%% | trace.json, timeline.png",
                 pipe["schedule"], 100 * pipe["bubble_measured"], 100 * pipe["bubble_simulated"], 100 * pipe["bubble_closed_form"])
    log.info(
        "traffic per step (all ranks): %.3f MB sent, theory %.3f MB (%s) | exposed comm %.1f ms/step",
        comm["sent_bytes_per_step"] / 1e6, expected["sent_bytes_per_step"] / 1e6,
        "exact match" if summary["comm_matches_theory"] else
        "MISMATCH" if summary["precision"] == "fp32" else "differs: the closed form counts fp32 activations",
        comm["exposed_seconds_per_step"] * 1e3,
    )
    for op, t in comm["by_op"].items():
        log.info("  %-16s %4d calls  %10.3f MB payload  %10.3f MB sent", op, t["calls"], t["payload_bytes"] / 1e6, t["sent_bytes"] / 1e6)
    for group, t in comm["by_group"].items():
        log.info("  group %-10s %4d calls  %10.3f MB sent", group, t["calls"], t["sent_bytes"] / 1e6)
    if any(tag.startswith("tp/") for tag in comm["by_tag_op"]):
        # The Megatron count: collectives per layer and direction, per rank and optimizer step.
        world = summary["world_size"]
        # In a pipeline each part's collectives run only on the ranks of the stage holding it
        # (world / pp of them); the sequence-sharded gradients' sum runs on every rank.
        holders = world // summary["parallel"]["pp"]
        log.info("tensor-parallel collectives per rank (of the stage holding the part) per step (%d microbatch(es)):",
                 summary["parallel"]["microbatches"])
        for tag, ops in comm["by_tag_op"].items():
            if tag.startswith("tp/"):
                ranks = world if tag == "tp/sp_grads" else holders
                log.info("  %-24s %s", tag, ", ".join(f"{t['calls'] // ranks} {op}" for op, t in ops.items()))
