"""The one training loop, for every strategy: set up, run the steps, report.

    plan (validated)  ->  corpus  ->  process groups  ->  model from the seed  ->  the registry's strategy
    for each step: global batch -> this rank's microbatches -> strategy.train_step -> loss on rank 0
    at the end: every rank's timings, traffic and memory gathered to rank 0 -> summary.json
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.host_memory import apply_host_allocator
from parallel.core.model import GPT, count_parameters
from parallel.core.precision import ForwardContext
from parallel.core.recompute import apply_recompute
from parallel.dist.binding import allowed_cores, bind_rank, threads_per_rank
from parallel.dist.comm import CommFailure, CommLog, calls_by_tag_op, summarize_traffic
from parallel.dist.gloo_loop import apply_gloo_loop_policy
from parallel.dist.groups import DistContext, LaunchEnv, init_distributed, shutdown
from parallel.dist.timing import StepTimer
from parallel.moe.stats import RoutingMeter
from parallel.net.probe import WireProbe
from parallel.reliability.chaos import open_job
from parallel.reliability.checkpoint import checkpoint_meta
from parallel.reliability.faults import gone_peers, inject_before_step, kill_during_save, peer_table, slow_down
from parallel.reliability.goodput_report import add_goodput
from parallel.reliability.hangs import report_hang, watch_for_hangs
from parallel.reliability.recovery import STARTED, Attempt, Journal, note_stopped
from parallel.reliability.resume import checkpoint_root, job_fields, load_resumed, losses_meta
from parallel.reliability.saving import CheckpointSaver
from parallel.reliability.straggler import StragglerMeter
from parallel.replay.events import step_record
from parallel.replay.probe import probe_loopback
from parallel.report.activations import ActivationMeter
from parallel.report.breakdown import rank_step_breakdown
from parallel.report.console import log_summary, step_line
from parallel.report.metrics import (
    MetricsWriter,
    close_logging,
    default_run_dir,
    reset_peak_memory,
    setup_logging,
    write_json,
)
from parallel.report.rank import rank_report
from parallel.report.summary import build_summary
from parallel.report.tensorboard import TensorBoardWriter
from parallel.report.virtual import replayable
from parallel.run_plan import ConfigError, RunPlan
from parallel.strategy import NonFiniteLoss, Strategy

log = logging.getLogger("parallel")


class TrainingStopped(RuntimeError):
    """The run stopped on purpose, on every rank (a non-finite loss); the message says why."""


@dataclass
class Run:
    """What one rank carries through the loop."""

    plan: RunPlan
    ctx: DistContext
    run_dir: Path
    strategy: Strategy
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    activation_peaks: list[int] = field(default_factory=list)  # bytes saved for backward, per step
    routing: list[list[dict]] = field(default_factory=list)  # MoE: tokens per expert of each call, per step
    wire: WireProbe | None = None  # the emulated network's link counters (launch.run), inert otherwise
    breakdowns: list = field(default_factory=list)  # per step, where the time went (report/breakdown.py)
    trace: dict | None = None  # the last step's phases and communication spans (report/trace.py)
    events: list[dict] = field(default_factory=list)  # timed steps' phases and calls, both clocks (parallel/replay/)
    links: object = None  # the replay's link model (parallel/replay/links.py), set after the steps
    cores: list[int] = field(default_factory=list)  # the cores this rank may run on, once bound (dist/binding.py)
    stragglers: StragglerMeter | None = None  # each rank's compute against its peers' (reliability/straggler.py)
    attempt: Attempt | None = None  # this attempt's start, and the failure before it (reliability/recovery.py)
    history: tuple[int, list[float]] = (0, [])  # the job's first step and losses before this attempt (a checkpoint's)
    checkpoints: list[dict] = field(default_factory=list)  # each save's cost on this rank (reliability/saving.py)
    job: object = None  # the job's timeline across restarts, and chaos's timer (reliability/job_log.py, chaos.py)


def train(plan: RunPlan, resolved_config: dict, env: LaunchEnv) -> Path:
    """Run the plan; returns the run directory (summary.json is in it on rank 0)."""
    torch.set_num_threads(threads_per_rank(env.local_world_size, plan.threads))
    host_allocator = apply_host_allocator(plan.host_allocator)  # before the run allocates (core/host_memory.py)
    corpus = load_corpus(plan.data_path, plan.data_max_bytes, plan.model.seq_len + 1)  # before any group
    comm_log = CommLog(enabled=plan.comm_log, timed=plan.comm_time)
    job = open_job(plan, env.rank)  # chaos's timer runs from here, through the set-up (reliability/chaos.py)
    ctx = init_distributed(env, plan.dims, plan.backend, plan.timeout_s, comm_log, plan.device_type)
    groups_ready = time.time()
    try:
        run = setup(plan, ctx, groups_ready, job)
        log.info("host allocator: %s", host_allocator)
        # Once the groups exist (each has its own gloo device and event-loop thread); again after
        # each warm-up step below, for the groups PyTorch's own strategies make lazily.
        log.info("gloo event loop: %s", apply_gloo_loop_policy(plan.gloo_loop_policy))
        run_steps(run, corpus)
        run.links = _link_model(run, resolved_config)
        report(run, resolved_config)
    except RuntimeError as e:
        if plan.resume_auto:  # first: torchrun may stop this rank any moment now (recovery.py's `detected`)
            e.detected_at = note_stopped(plan.run_dir, ctx.rank, plan.attempt)
        # A call failed (ours name themselves: CommFailure; DDP's reducer raises plain
        # RuntimeErrors): if a peer on this machine is gone, the message will name it.
        if len(ctx.peers) > 1 and (isinstance(e, CommFailure) or "Connection" in str(e)):
            e.gone_peers = gone_peers(ctx.peers, ctx.rank)
        report_hang(ctx, e)  # a timeout: every rank's flight recorder dumped, and the verdict (reliability/hangs.py)
        raise
    finally:
        close_logging()
    # Only after success: a rank that failed must not wait in a barrier for peers that may be
    # stuck in a collective waiting for it; it exits and torchrun stops the others.
    shutdown(ctx)
    return run.run_dir


# -- set up -----------------------------------------------------------------------------------------
def setup(plan: RunPlan, ctx: DistContext, groups_ready: float, job) -> Run:
    """The run directory and logs, the strategy the registry builds, and the resumed state if any."""
    run_dir = _resolve_run_dir(plan, ctx)
    setup_logging(run_dir, ctx.rank, append=plan.attempt > 0)  # an earlier attempt's log stays
    watch_for_hangs(ctx, run_dir)
    attempt = Attempt.start(Journal(run_dir, ctx.rank, plan.attempt), groups_ready)
    if plan.resume_auto and ctx.is_rank0:
        attempt.journal.append(STARTED)  # every rank has counted the attempts before this one (resume.py)
    job.bind(run_dir)
    ctx.peers = peer_table(ctx.comm("world"))
    # Once the groups (and their gloo threads) exist, before the model: a core per rank where the
    # machine has one for each (dist/binding.py).
    cores = bind_rank(plan.pin_cores, [machine for _, _, machine in ctx.peers], ctx.rank, torch.get_num_threads(),
                      ctx.device.type)
    log.info(
        "run %s | strategy %s | world %d = dp %d x cp %d x tp %d x pp %d | backend %s | device %s | precision %s "
        "| rank %d pid %d",
        run_dir, plan.strategy, plan.dims.world_size, plan.dims.dp, plan.dims.cp, plan.dims.tp, plan.dims.pp,
        plan.backend or "none", ctx.device, plan.layout.precision, ctx.rank, os.getpid(),
    )
    # Where this process runs (torchrun's GROUP_RANK is the node's rank): the per-rank logs show the layout.
    logging.getLogger("parallel.rank").info(
        "rank %d | node %s | local rank %d of %d | coords %s | cores: %s", ctx.rank, os.environ.get("GROUP_RANK", "0"),
        ctx.env.local_rank, ctx.env.local_world_size, ctx.coords, cores,
    )
    layout_warning = plan.dims.node_layout_warning(ctx.env.local_world_size)
    if layout_warning and ctx.is_rank0:
        log.warning("warning: %s", layout_warning)
    # The one model, built from the seed on every rank, then transformed by the strategy.
    model = GPT(plan.model, seed=plan.seed).to(ctx.device)
    strategy = plan.spec.build(model, plan, ctx)
    # Recomputation wraps the blocks as the strategy left them (shards, cp cores, pipeline chunks).
    apply_recompute(model, plan.layout.recompute, strategy.phases)
    strategy.forward_context = ForwardContext(plan.layout.precision, ctx.device)
    strategy.finite_comm, strategy.check_finite = ctx.comm("world"), plan.check_finite
    attempt.setup_s, attempt.resumed_at = time.time() - groups_ready, plan.start_step
    *history, attempt.load_s = load_resumed(strategy, plan, log)
    log.info("model: %d parameters (%d on this rank) | %d tokens per step | %d microbatch(es) of %d sequences per rank",
             strategy.full_parameter_count(), count_parameters(strategy.model), plan.tokens_per_step,
             plan.microbatches, plan.layout.microbatch_size)
    steps_run = plan.steps - plan.start_step
    log.info("timing: %d warm-up step(s) not timed%s, %d timed", plan.warmup_steps,
             f" (train.warmup_steps=null: min(3, half of the {steps_run} steps run))" if plan.warmup_default else "",
             steps_run - plan.warmup_steps)
    job.setup_done()  # the job log's set-up span ends here; steps follow
    return Run(plan, ctx, run_dir, strategy, cores=allowed_cores(), attempt=attempt, history=tuple(history), job=job)


def _resolve_run_dir(plan: RunPlan, ctx: DistContext) -> Path:
    """Rank 0 names the run directory and tells the others, so all ranks write to one place."""
    run_dir = plan.run_dir or default_run_dir(plan.strategy, plan.dims.world_size)
    world = ctx.comm("world")
    if world is not None:
        run_dir = world.broadcast_object(run_dir, 0, tag="tooling/run_dir")
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- the steps --------------------------------------------------------------------------------------
def run_steps(run: Run, corpus: torch.Tensor) -> None:
    plan, ctx, strategy = run.plan, run.ctx, run.strategy
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    metrics = MetricsWriter(run.run_dir / "metrics.jsonl", append=plan.attempt > 0) if ctx.is_rank0 else None
    board = TensorBoardWriter.open(plan.tensorboard, plan.tensorboard_dir, run.run_dir) if ctx.is_rank0 else None
    saver = CheckpointSaver(plan, ctx, strategy, checkpoint_root(plan.checkpoint_dir, run.run_dir))
    run.checkpoints = saver.records
    timer = StepTimer(ctx.device)  # CUDA events on a GPU, the host clock on the CPU
    clock = ctx.log.clock = timer.clock  # it stamps the step's phases and calls too, on the step's own axis
    activations = ActivationMeter(strategy.model.parameters())  # what autograd holds for backward
    routing = RoutingMeter(strategy.model)  # where MoE blocks sent this rank's tokens (nothing for a dense model)
    run.routing = routing.steps
    # The emulated network's link counters around the timed steps (launch.run only; inert otherwise).
    run.wire = WireProbe.from_environ(ctx, plan.start_step + plan.warmup_steps)
    run.stragglers = StragglerMeter(ctx.comm("world"), plan.dims, ctx.rank, plan.straggler_window,
                                    plan.straggler_threshold, ctx.device)
    for step in run.wire.steps(range(plan.start_step, plan.steps)):
        global_batch = batches(step)
        microbatches = [mb.to(ctx.device) for mb in
                        local_microbatches(global_batch, ctx.coords["dp"], plan.dims.dp, plan.microbatches)]
        run.attempt.reached(step, run.step_times)  # back where the previous attempt failed? (recovery.py)
        inject_before_step(plan.fail_mode, plan.fail_at_step, plan.fail_rank, step, ctx.rank,
                           strategy.model.parameters(), run.attempt.journal)
        if plan.start_step < step <= plan.start_step + plan.warmup_steps:
            apply_gloo_loop_policy(plan.gloo_loop_policy)  # groups made during the steps before (dist/gloo_loop.py)
        if step == plan.start_step + plan.warmup_steps:
            reset_peak_memory(ctx.device)  # the peak is the timed steps' (report/metrics.py)
        ctx.log.begin_step()
        timer.start()
        strategy.phases.begin_step(clock)
        with activations.step(), routing.step():
            local_loss = _guarded_step(run, step, microbatches, global_batch.n_tokens)
        strategy.phases("other", "training loop")
        seconds = timer.stop()
        strategy.phases.stop()
        run.activation_peaks.append(activations.peak)
        if step == plan.start_step:
            _check_forward_context(plan, strategy)
        loss = strategy.global_loss(local_loss)  # tooling traffic, outside the timed region
        straggling = run.stragglers.step(step, clock.end_cpu - clock.origin_cpu)  # tooling too
        traffic = ctx.log.end_step()
        _record_phases(run, step, seconds, clock)
        if plan.save_grads and step == 0:
            _save_grads(run)
        run.losses.append(loss)
        run.step_times.append(seconds)
        if metrics is not None:
            _record_step(run, metrics, board, step, loss, seconds, traffic, global_batch.checksum(), straggling)
        run.job.step_done(step)
        if plan.checkpoint_every and (step + 1) % plan.checkpoint_every == 0:
            _save_checkpoint(run, saver, step + 1)
    saver.wait()  # the last asynchronous save is written before the run reports
    strategy.close()
    run.job.job_done()
    if metrics is not None:
        metrics.close()
    if board is not None:
        board.close()


def _record_phases(run: Run, step: int, seconds: float, clock) -> None:
    """Where the step's time went (breakdown), its trace, and for a timed step its replay record."""
    spans = run.ctx.log.last_spans
    phases = run.strategy.phases.resolve()
    run.breakdowns.append(rank_step_breakdown(phases, spans, seconds))
    run.trace = {"step": step, "origin_wall": clock.origin_wall, "phases": phases, "spans": spans}
    if step - run.plan.start_step >= run.plan.warmup_steps and phases:
        run.events.append(step_record(step, seconds, clock.end_cpu - clock.origin_cpu, phases, spans))


def _save_grads(run: Run) -> None:
    """Step 0's full-model gradients: the optimizer step leaves .grad alone, so these are the synced
    gradients it used (collective; rank 0 writes)."""
    grads = run.strategy.full_grads()
    if run.ctx.is_rank0:
        torch.save(grads, run.run_dir / "grads_step0.pt")


def _record_step(run: Run, metrics: MetricsWriter, board, step: int, loss: float, seconds: float, traffic,
                 checksum, straggling: dict) -> None:
    """Rank 0's line of metrics.jsonl for the step (and TensorBoard's, and the log's)."""
    plan = run.plan
    warmup = step - plan.start_step < plan.warmup_steps
    sent = float(summarize_traffic(traffic)["total"].sent_bytes)
    record = {
        "step": step, "loss": loss, "step_time_s": seconds, "warmup": warmup,
        "tokens_per_s": plan.tokens_per_step / seconds, "rank0_sent_bytes": sent,
        "data_checksum": checksum, "rank0_calls": calls_by_tag_op(traffic), **straggling,
    }
    metrics.write(record)
    if board is not None:
        board.write(record, run.breakdowns[-1], summarize_traffic(traffic))
    log.info(step_line(step, loss, seconds, sent, None if warmup else plan.tokens_per_step / seconds))


def _guarded_step(run: Run, step: int, microbatches, global_tokens: int) -> torch.Tensor:
    """One optimizer step, which must have checked that every rank's loss is finite before it."""
    strategy = run.strategy
    guarded = strategy.finite_checks
    try:
        local_loss = strategy.train_step(microbatches, global_tokens)
    except NonFiniteLoss as e:
        # Every rank gets here at the same step (the flag was all-reduced): say it in every
        # rank's log, then stop with the weights and moments of the last good step.
        message = (f"non-finite loss at step {step} ({e}): stopped before the optimizer step, weights unchanged; "
                   "lower train.lr, or resume from the last checkpoint")
        log.error("error: %s", message)
        raise TrainingStopped(message) from None
    if strategy.finite_checks != guarded + 1:
        raise AssertionError(f"strategy {run.plan.strategy} ran its optimizer step without guard_finite(local_loss) "
                             "(parallel/strategy.py): call it once per step, before optimizer.step()")
    plan = run.plan  # train.fail_mode=slow stretches the step's compute so far, on the clock (reliability/faults.py)
    slow_down(plan.fail_mode, plan.fail_at_step, plan.fail_rank, plan.slow_factor, step, run.ctx.rank,
              run.ctx.log.clock.origin_cpu)
    return local_loss


def _check_forward_context(plan: RunPlan, strategy: Strategy) -> None:
    """Every rank runs a forward pass each step, so every rank reaches the same verdict here."""
    if plan.layout.precision != "fp32" and strategy.forward_context.entered == 0:
        raise ConfigError(
            f"train.precision={plan.layout.precision} is not implemented by parallel={plan.strategy}: its "
            "train_step runs the forward pass outside Strategy.forward_context, so it would train in fp32; "
            "use train.precision=fp32"
        )


def _save_checkpoint(run: Run, saver: CheckpointSaver, steps_done: int) -> None:
    """Every rank takes part (a gathered save is collective; a sharded one writes each rank's part)."""
    plan = run.plan
    first, before = run.history
    meta = checkpoint_meta(plan, steps_done) | losses_meta(first, [*before, *run.losses])
    saver.save(steps_done, meta, before_rename=kill_during_save(plan.fail_mode, plan.fail_at_step, steps_done,
                                                                run.attempt.journal))
    run.job.save_done(steps_done)


def _link_model(run: Run, resolved_config: dict):
    """The replay's links: an emulated network's net.* (launch.run), else this machine's loopback,
    probed with one rank per core unless the config gives it (every rank takes part). None on a GPU
    or under NCCL, where the virtual clock does not apply and nothing is probed
    (parallel/report/virtual.py: `replayable`)."""
    from parallel.replay.links import from_net

    world = run.ctx.comm("world")
    if not replayable(run.ctx.device.type, world.backend if world is not None else None):
        return None
    virtual = dict(resolved_config.get("virtual") or {})
    settings = run.wire.settings if run.wire is not None else None
    node_of = (lambda r: r // int(settings.get("procs_per_node") or 1)) if settings else (lambda r: 0)
    if settings and settings.get("placement") == "cyclic":
        node_of = lambda r: r % int(settings.get("nodes") or 1)  # noqa: E731
    loop = probe_loopback(world, node_of, virtual, run.plan.gloo_loop_policy)
    return from_net(settings, loop) if settings and settings.get("name") != "none" else loop


# -- report -----------------------------------------------------------------------------------------
def report(run: Run, resolved_config: dict) -> None:
    """Every rank's report to rank 0 (collective), the final model if asked, and summary.json."""
    plan, ctx = run.plan, run.ctx
    world = ctx.comm("world")
    # Collective, for the final hash (and final_model.pt if asked): before this rank's report, so that
    # its bytes are among the calls outside the steps the summary counts.
    state = run.strategy.full_state_dict()
    mine = rank_report(run)  # parallel/report/rank.py
    reports = world.gather_object(mine, 0, tag="tooling/summary") if world is not None else [mine]
    if plan.save_final and ctx.is_rank0:
        torch.save(state, run.run_dir / "final_model.pt")
    if not ctx.is_rank0:
        return
    net = run.wire.summary(reports, plan.warmup_steps) if run.wire is not None else None
    summary = build_summary(config=resolved_config, plan=plan, losses=run.losses, rank_reports=reports,
                            device=ctx.device, run_dir=run.run_dir, net=net, links=run.links)
    summary["stragglers"] = run.stragglers.summary() if run.stragglers is not None else None
    add_goodput(summary, run.run_dir, plan)
    summary.update(job_fields(plan, *run.history, run.losses, run.attempt.journal, state, log))
    write_json(run.run_dir / "summary.json", summary)
    log_summary(summary)
    log.info("wrote %s", run.run_dir / "summary.json")
