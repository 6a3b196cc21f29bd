"""From the Hydra config to a validated run plan, before any process group exists.

Everything that can be wrong with a configuration is caught here, on every rank, from the config
and the torchrun environment alone. A wrong value ends in one sentence that names it, the rule it
breaks and a fix, and a non-zero exit: never a hang inside a collective.

This file is the order the rules run in, and it names no family: each family's options are parsed
and checked by the family itself (parallel/family.py, through the registry), its refusals are its
rules.py's. Besides them run the registry's rules every entry shares (world size, dimensions,
mixtures of experts, a tied head: a run's rule the planner skips), the entries' own (`check`,
`check_model`), and the configuration's that belong to no strategy (numbers, precision,
recomputation, faults, checkpoints), here. Which
entry runs the layout is parallel/compose/route.py's table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parallel.core.host_memory import HOST_ALLOCATORS
from parallel.core.model import GPTConfig
from parallel.core.precision import PRECISIONS
from parallel.core.recompute import MODES as RECOMPUTE_MODES
from parallel.dist.binding import PIN_CHOICES
from parallel.dist.dims import SIZES, LayoutError, ParallelDims
from parallel.dist.gloo_loop import GLOO_LOOP_POLICIES
from parallel.dist.groups import LaunchEnv, choose_backend, choose_device_type
from parallel.dist.timing import default_warmup_steps
from parallel.family import Check
from parallel.layout import Layout
from parallel.registry import (
    REGISTRY,
    check_layout,
    check_model,
    check_optimizer,
    check_rules,
    check_tied_head,
    parse_options,
    resolve,
    spec_of,
)
from parallel.reliability.chaos import chaos_error
from parallel.reliability.checkpoint import MODEL_KEYS, check_resumable, read_meta, resolve_checkpoint
from parallel.reliability.faults import FAIL_MODES, faults_by_attempt
from parallel.reliability.resume import AUTO, attempt_number, checkpoint_root, job_run_dir, newest_checkpoint
from parallel.report.tensorboard import option_error
from parallel.spec import ConfigError, StrategySpec

__all__ = ["ConfigError", "LayoutError", "RunPlan", "build_plan", "model_config"]


@dataclass(frozen=True)
class RunPlan:
    strategy: str
    model: GPTConfig
    layout: Layout  # the dimensions, microbatches, precision, recomputation and every family's options
    backend: str | None
    timeout_s: float
    steps: int
    warmup_steps: int
    global_batch: int
    lr: float
    weight_decay: float
    seed: int
    threads: int | None
    host_allocator: str
    gloo_loop_policy: str
    pin_cores: str
    data_path: str | None
    data_max_bytes: int
    run_dir: str | None
    comm_log: bool
    comm_time: bool
    save_final: bool
    save_grads: bool
    peak_flops: float | None = None  # per device, for MFU; None: measured by a matmul at the end of the run
    device_type: str = "cpu"  # "cuda" under NCCL, or for a single process where a GPU is visible
    # Reliability (parallel/reliability/checkpoint.py, parallel/reliability/faults.py)
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    checkpoint_async: bool = False  # a host snapshot written by a background thread (reliability/saving.py)
    checkpoint_sharded: bool = False  # each rank writes the pieces it holds (reliability/sharded.py)
    resume_from: str | None = None  # one complete checkpoint directory, resolved
    resume_auto: bool = False  # train.resume=auto: the job's newest checkpoint, if any (reliability/resume.py)
    attempt: int = 0  # this attempt of the job: torchrun's restart count
    start_step: int = 0
    check_finite: bool = True
    fail_mode: str | None = None
    tensorboard: bool = False  # train.tensorboard: event files by rank 0 (parallel/report/tensorboard.py)
    tensorboard_dir: str | None = None  # null: <run dir>/tensorboard
    fail_at_step: int | None = None
    fail_rank: int = 0
    slow_factor: float = 2.0  # train.fail_mode=slow: the slowed rank's compute, times
    straggler_window: int = 5  # steps the straggler score looks back over (parallel/reliability/straggler.py)
    straggler_threshold: float = 1.5  # a score from which a rank is flagged
    chaos_mtbf_s: float | None = None  # train.chaos: a seeded random kill of a random rank (reliability/chaos.py)
    chaos_seed: int = 0
    warmup_default: bool = False  # train.warmup_steps was null: default_warmup_steps of the steps run
    timeline: bool = True  # run.timeline: draw timeline.png beside trace.json
    optimizer: str = "adamw"  # train.optimizer: adamw | sgd (parallel/core/optim.py)

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dims.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    @property
    def spec(self) -> StrategySpec:
        return spec_of(self.strategy)



def model_config(section) -> GPTConfig:
    """The model config from the cfg's `model` section: every field a preset sets (GPT-2's block by
    default; Llama's with the shape fields of parallel/core/config.py), checked by GPTConfig."""
    from parallel.core.shape import ModelShape, ShapeError

    try:
        return ModelShape.from_preset({k: section[k] for k in section}).gpt
    except ShapeError as e:
        raise ConfigError(str(e)) from None


def _check_steps(steps: int, warmup_steps: int | None) -> None:
    """`warmup_steps` None (the default) is resolved once the first step is known (resume)."""
    if not _is_int(steps) or steps < 1:
        raise ConfigError(f"train.steps={steps!r} must be a positive integer")
    if warmup_steps is not None and (not _is_int(warmup_steps) or not 0 <= warmup_steps < steps):
        raise ConfigError(
            f"train.warmup_steps={warmup_steps!r} must be at least 0 and below train.steps={steps}, "
            "so that some steps are timed: lower it, raise train.steps, or leave it null (the default: "
            "min(3, half of the steps))"
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(cfg) -> None:
    """Types and ranges of the numeric options that no layout rule covers (a string or a negative
    number must not reach torch as a traceback)."""
    t, p = cfg.train, cfg.parallel
    positive = [("train.lr", t.lr, "e.g. train.lr=0.001"),
                ("parallel.timeout_s", p.timeout_s, "e.g. parallel.timeout_s=60")]
    for name, value, hint in positive:
        if not _is_number(value) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive number: {hint}")
    if not _is_number(t.weight_decay) or t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay={t.weight_decay!r} must be a number >= 0: e.g. train.weight_decay=0.1")
    for name, value, low in [("train.seed", t.seed, 0), ("data.max_bytes", cfg.data.max_bytes, 1),
                             ("train.checkpoint_every", t.checkpoint_every, 0)]:
        if not _is_int(value) or value < low:
            raise ConfigError(f"{name}={value!r} must be an integer >= {low}")
    if t.threads is not None and (not _is_int(t.threads) or t.threads < 1):
        raise ConfigError(f"train.threads={t.threads!r} must be a positive integer, "
                          "or null to share the cores among the ranks")
    if t.get("host_allocator", "keep") not in HOST_ALLOCATORS:
        raise ConfigError(f"train.host_allocator={t.get('host_allocator')!r}: "
                          f"choose one of {', '.join(HOST_ALLOCATORS)} "
                          "(keep: freed host memory stays in the process; system: the C library's defaults)")
    if t.get("gloo_loop_policy", "batch") not in GLOO_LOOP_POLICIES:
        raise ConfigError(f"train.gloo_loop_policy={t.get('gloo_loop_policy')!r}: "
                          f"choose one of {', '.join(GLOO_LOOP_POLICIES)} "
                          "(batch: gloo's event-loop threads never preempt on wake-up; normal: the kernel's default)")
    if t.get("pin_cores", "auto") not in PIN_CHOICES:
        raise ConfigError(f"train.pin_cores={t.get('pin_cores')!r}: choose one of {', '.join(PIN_CHOICES)} "
                          "(auto: each rank on a core of its own where the machine has one for every rank; "
                          "off: the kernel places the threads)")
    for name, value in [("train.check_finite", t.check_finite), ("train.save_final", t.save_final),
                        ("train.save_grads", t.save_grads), ("comm.log", cfg.comm.log),
                        ("train.checkpoint_async", t.get("checkpoint_async", False)),
                        ("train.checkpoint_sharded", t.get("checkpoint_sharded", False)),
                        ("comm.time", cfg.comm.time), ("run.timeline", cfg.run.get("timeline", True))]:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be true or false")
    tensorboard_error = option_error(t.get("tensorboard", False), t.get("tensorboard_dir"))
    if tensorboard_error:
        raise ConfigError(tensorboard_error)


def _attempt_fault(t, world_size: int, attempt: int) -> dict:
    """The fault-injection testing aid (parallel/reliability/faults.py): every attempt's fault
    checked (a mode, a step the run reaches, a rank that exists), this attempt's kept; and the
    straggler score's window and threshold (parallel/reliability/straggler.py)."""
    _check_stragglers(t)
    try:
        faults = faults_by_attempt(t.fail_mode, t.fail_at_step, t.fail_rank)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for mode, step, rank in faults:
        if mode is not None:  # null in a list: no fault in that attempt
            _check_fault(t, world_size, mode, step, rank)
    mode, step, rank = faults[attempt] if attempt < len(faults) else (None, None, 0)
    return dict(fail_mode=mode, fail_at_step=step, fail_rank=rank)


def _check_stragglers(t) -> None:
    window, threshold = t.get("straggler_window", 5), t.get("straggler_threshold", 1.5)
    if not _is_int(window) or window < 1:
        raise ConfigError(f"train.straggler_window={window!r} must be a number of steps, 1 or more (e.g. 5)")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not threshold > 1:
        raise ConfigError(f"train.straggler_threshold={threshold!r} must be a score above 1 (e.g. 1.5)")


def _check_fault(t, world_size: int, mode, at_step, rank) -> None:
    if mode not in FAIL_MODES:
        raise ConfigError(f"train.fail_mode={mode!r}: choose one of {', '.join(FAIL_MODES)}, or null (no fault)")
    factor = t.get("slow_factor", 2.0)
    if mode == "slow" and (not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 1):
        raise ConfigError(f"train.slow_factor={factor!r} must be a number above 1 (e.g. 2.0): "
                          "the slowed rank's compute, times")
    last = t.steps if mode == "kill_during_save" else t.steps - 1
    if not _is_int(at_step) or not 0 <= at_step <= last:
        raise ConfigError(f"train.fail_at_step={at_step!r} must be a step this run reaches, 0 to {last}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ConfigError(f"train.fail_rank={rank!r} must be a rank of this run, 0 to {world_size - 1}")
    if mode == "kill_during_save":
        if rank != 0:
            raise ConfigError("train.fail_mode=kill_during_save kills the checkpoint writer, which is rank 0: "
                              "set train.fail_rank=0")
        if not t.checkpoint_every or at_step % t.checkpoint_every or at_step == 0:
            raise ConfigError(
                f"train.fail_mode=kill_during_save with train.fail_at_step={at_step}: "
                f"no checkpoint is saved after {at_step} steps (train.checkpoint_every={t.checkpoint_every}): "
                "use a multiple of checkpoint_every"
            )


def _warmup_steps(t, start_step: int) -> int:
    """train.warmup_steps, or its default for the steps this run takes; a resume=auto attempt keeps
    at least one timed step, however close to the end it restarted."""
    warmup = default_warmup_steps(t.steps - start_step) if t.warmup_steps is None else t.warmup_steps
    return min(warmup, max(0, t.steps - start_step - 1)) if t.resume == AUTO else warmup


def _resume_point(t, model: GPTConfig, cfg, run_dir: str | None) -> tuple[str | None, int]:
    """The checkpoint to resume from and the step it continues at (or None, 0). `auto`: the
    newest complete one of this job's checkpoints, where there is one (reliability/resume.py)."""
    if t.resume is None:
        return None, 0
    if t.resume == AUTO:
        checkpoint = newest_checkpoint(checkpoint_root(t.checkpoint_dir, run_dir))
        if checkpoint is None:
            return None, 0
    else:
        checkpoint = resolve_checkpoint(str(t.resume))
    plan_model = {k: getattr(model, k) for k in MODEL_KEYS}
    plan_data = {"seed": t.seed, "global_batch": t.global_batch, "data_path": cfg.data.path,
                 "data_max_bytes": cfg.data.max_bytes, "seq_len": model.seq_len}
    # A restarted attempt is not refused for its warm-up: it keeps at most what the steps left allow
    # (build_plan), since a job that stopped near its end must still finish.
    start = check_resumable(read_meta(checkpoint), plan_model, plan_data, t.steps,
                            None if t.resume == AUTO else t.warmup_steps,
                            str(checkpoint) if t.resume == AUTO else str(t.resume))
    return str(checkpoint), start


def _resolve_dims(world_size: int, p) -> ParallelDims:
    """The layout from parallel.*; `parallel.ep: null` (the ep preset) means every dp rank is an
    expert-parallel rank: ep = dp, whatever dp the world leaves."""
    sizes = {d: p.get(d, 1) for d in SIZES}  # every dimension of parallel/dist/dims.py, 1 where unset
    ep = sizes["ep"]
    dims = ParallelDims.resolve(world_size, **{**sizes, "ep": 1 if ep is None else ep})
    return replace(dims, ep=dims.dp) if ep is None else dims


def _check_precision(precision) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(
            f"train.precision={precision!r} is not one of {', '.join(PRECISIONS)}: use fp32 (the default, what the "
            "exact comparisons with the single run need) or bf16 (autocast with fp32 master weights)"
        )


def check_recompute(recompute, strategy: str, spec: StrategySpec) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}: none keeps every "
                          "activation, selective recomputes the attention cores, full recomputes every block")
    if recompute != "none" and not spec.recompute:
        raise ConfigError(
            f"train.recompute={recompute} is this project's transform of its own blocks (parallel/core/recompute.py), "
            f"but parallel={strategy} does not take it (its registry entry says recompute=False: PyTorch's own "
            "strategies, and zero3, whose hooks gather each block's parameters once per forward); "
            "set train.recompute=none"
        )


def build_plan(cfg, env: LaunchEnv, cuda_available: bool, planning: bool = False,
               replay_schedule: bool = True) -> RunPlan:
    """Validate the whole configuration against the launch environment, in the order the rules run.
    `planning`: the planner's question (would this layout run on a cluster's implementation of the
    strategies?), which skips the refusals of what only this sandbox's code cannot train (a tied head).
    `replay_schedule=False`: the pipeline's posting is not played here (the search plays it only for the
    rows that fit: `parallel.pp.rules.posting_refusal`)."""
    t = cfg.train
    _check_numbers(cfg)
    model = model_config(cfg.model)
    if model.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is below 256, but the data is byte-level (token ids 0..255): "
            "use model.vocab_size=256 (or more)"
        )
    backend = choose_backend(cfg.parallel.backend, cuda_available) if env.world_size > 1 else None
    strategy, layout = _checked_layout(cfg, model, env.world_size, backend, replay_schedule)
    if not planning:
        check_tied_head(strategy, model)
    _check_steps(t.steps, t.warmup_steps)
    _check_precision(t.precision)
    check_recompute(layout.recompute, strategy, spec_of(strategy))
    run_dir = job_run_dir(cfg.run.dir, strategy, env.world_size) if t.resume == AUTO else cfg.run.dir
    attempt = attempt_number(run_dir if t.resume == AUTO else None)
    fault = _attempt_fault(t, env.world_size, attempt)
    if chaos_error(t.get("chaos") or {}):
        raise ConfigError(chaos_error(t.get("chaos") or {}))
    _check_checkpoints(t, strategy)
    check_optimizer(strategy, t.get("optimizer", "adamw"))
    resume_from, start_step = _resume_point(t, model, cfg, run_dir)
    return RunPlan(
        strategy=strategy, model=model, layout=layout, backend=backend,
        device_type=choose_device_type(cfg.parallel.backend, backend, cuda_available),
        timeout_s=float(cfg.parallel.timeout_s), steps=t.steps,
        warmup_steps=_warmup_steps(t, start_step),
        warmup_default=t.warmup_steps is None, resume_from=resume_from, start_step=start_step,
        peak_flops=_peak_flops(t.get("peak_flops")), **_run_fields(cfg), run_dir=run_dir,
        resume_auto=t.resume == AUTO, attempt=attempt, **fault,
    )


def _checked_layout(cfg, model: GPTConfig, world_size: int, backend: str | None,
                    replay_schedule: bool = True) -> tuple[str, Layout]:
    """The entry that runs the request and its layout, every family's rule passed: the dimensions,
    each family's options (each record checks its values), the route table, the rules every entry
    shares, the global batch's split, then every family's refusals (under `backend`'s rules, where
    they depend on it: the pipeline's) and those across families."""
    p, t = cfg.parallel, cfg.train
    dims = _resolve_dims(world_size, p)
    requested = spec_of(p.name)
    strategy, options = resolve(p.name, dims, parse_options(p))
    spec = check_layout(strategy, dims)
    check_model(strategy, model, dims)
    dims.check_batch(t.global_batch, p.microbatches)
    layout = Layout(dims=dims, microbatches=p.microbatches, microbatch_size=t.global_batch // dims.dp // p.microbatches,
                    recompute=t.get("recompute", "none"), precision=t.precision, options=options)
    check_rules(Check(model, layout, spec, requested, REGISTRY, backend, replay_schedule))
    return strategy, layout


def _check_checkpoints(t, strategy: str) -> None:
    if not spec_of(strategy).checkpoints and (t.checkpoint_every or t.resume is not None):
        what = f"train.checkpoint_every={t.checkpoint_every}" if t.checkpoint_every else f"train.resume={t.resume!r}"
        raise ConfigError(f"{what}: parallel={strategy} cannot save or load checkpoints (its registry entry says "
                          "checkpoints=False): set train.checkpoint_every=0 and train.resume=null, "
                          "or use another strategy")


def _run_fields(cfg) -> dict:
    """What the run does besides its layout: training, the machine, outputs, reliability, as configured."""
    t = cfg.train
    return dict(
        global_batch=t.global_batch, lr=float(t.lr), weight_decay=float(t.weight_decay), seed=int(t.seed),
        threads=t.threads, host_allocator=str(t.get("host_allocator", "keep")),
        gloo_loop_policy=str(t.get("gloo_loop_policy", "batch")), pin_cores=str(t.get("pin_cores", "auto")),
        data_path=cfg.data.path, data_max_bytes=int(cfg.data.max_bytes),
        comm_log=bool(cfg.comm.log), comm_time=bool(cfg.comm.time), timeline=bool(cfg.run.get("timeline", True)),
        save_final=bool(t.save_final), save_grads=bool(t.save_grads),
        checkpoint_every=t.checkpoint_every, checkpoint_dir=t.checkpoint_dir, check_finite=t.check_finite,
        checkpoint_async=t.get("checkpoint_async", False), checkpoint_sharded=t.get("checkpoint_sharded", False),
        slow_factor=float(t.get("slow_factor", 2.0)), straggler_window=int(t.get("straggler_window", 5)),
        straggler_threshold=float(t.get("straggler_threshold", 1.5)),
        chaos_mtbf_s=(t.get("chaos") or {}).get("mtbf_s"), chaos_seed=int((t.get("chaos") or {}).get("seed", 0)),
        tensorboard=bool(t.get("tensorboard", False)), tensorboard_dir=t.get("tensorboard_dir"),
        optimizer=str(t.get("optimizer", "adamw")),
    )


def _peak_flops(value) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"train.peak_flops={value!r} must be a positive number of FLOP/s per device, "
                          "or null to measure it")
    return float(value)
