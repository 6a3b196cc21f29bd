"""From the Hydra config to a validated run plan, before any process group exists.

Everything that can be wrong with a configuration is caught here, on every rank, from the config
and the torchrun environment alone. A wrong value ends in one sentence that names it, the rule it
breaks and a fix, and a non-zero exit: never a hang inside a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .checkpoint import MODEL_KEYS, check_resumable, read_meta, resolve_checkpoint
from .dims import LayoutError, ParallelDims
from .distributed import LaunchEnv, choose_backend, choose_device_type
from .faults import FAIL_MODES
from .model import GPTConfig
from .precision import PRECISIONS
from .pp.schedules import ScheduleError, build_schedule
from .pp.split import SplitError, layer_counts

# Strategy name -> what it needs of the layout. Later strategies add themselves here.
STRATEGIES = ("single", "dp", "torch_ddp", "tp", "pp", "3d", "zero1", "zero2", "zero3", "torch_fsdp2",
              "torch_tp", "torch_pp", "accelerate_ddp")
# Sharded data parallelism: pure dp layouts, at least two ranks to shard over.
SHARDED = ("zero1", "zero2", "zero3", "torch_fsdp2")
GRAD_SYNCS = ("bucketed", "naive")
# parallel.zero: how the dp dimension of a layout syncs, 0 plain (all-reduce), 1 or 2 a ZeRO stage.
ZERO_STAGES = (0, 1, 2, 3)


class ConfigError(ValueError):
    """A configuration value that cannot run."""


@dataclass(frozen=True)
class RunPlan:
    strategy: str
    model: GPTConfig
    dims: ParallelDims
    microbatches: int
    sequence_parallel: bool
    grad_sync: str
    bucket_mb: float
    backend: str | None
    timeout_s: float
    steps: int
    warmup_steps: int
    global_batch: int
    lr: float
    weight_decay: float
    seed: int
    threads: int | None
    data_path: str | None
    data_max_bytes: int
    run_dir: str | None
    comm_log: bool
    comm_time: bool
    save_final: bool
    save_grads: bool
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_layers: tuple[int, ...] | None = None
    peak_flops: float | None = None  # per device, for MFU; None: measured by a matmul at the end of the run
    precision: str = "fp32"
    device_type: str = "cpu"  # "cuda" under NCCL, or for a single process where a GPU is visible
    zero: int = 0  # parallel.zero: the ZeRO stage of the dp dimension of a 3d layout (0: plain all-reduce)
    # Reliability (parallel/checkpoint.py, parallel/faults.py)
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume_from: str | None = None  # one complete checkpoint directory, resolved
    start_step: int = 0
    check_finite: bool = True
    fail_mode: str | None = None
    fail_at_step: int | None = None
    fail_rank: int = 0

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dims.dp

    @property
    def microbatch_size(self) -> int:
        return self.local_batch // self.microbatches

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len


def model_config(cfg) -> GPTConfig:
    try:
        return GPTConfig(
            vocab_size=cfg.vocab_size,
            seq_len=cfg.seq_len,
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            mlp_ratio=cfg.mlp_ratio,
            dropout=cfg.dropout,
            vocab_pad_multiple=cfg.vocab_pad_multiple,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_strategy(strategy: str, dims: ParallelDims) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"parallel.name={strategy!r} is not a strategy: choose one of {', '.join(STRATEGIES)}")
    if strategy == "single" and dims.world_size != 1:
        raise LayoutError(
            f"parallel=single runs one process but the world size is {dims.world_size}: "
            f"run `python -m launch.train parallel=single`, or use parallel=dp under torchrun"
        )
    if strategy in ("torch_ddp", "accelerate_ddp", "torch_tp", "torch_pp") and dims.world_size < 2:
        raise LayoutError(
            f"parallel={strategy} needs at least 2 processes, got world size 1: "
            "launch it with torchrun --nproc-per-node 2 (or more)"
        )
    if strategy == "torch_pp":
        if dims.tp != 1 or dims.dp != 1:
            raise LayoutError(
                f"parallel=torch_pp runs one torch.distributed.pipelining pipeline over the whole world, but "
                f"parallel.dp={dims.dp} and parallel.tp={dims.tp}: set parallel.dp=1 parallel.tp=1"
            )
        return
    if strategy == "torch_tp":
        if dims.pp != 1:
            raise LayoutError(f"parallel=torch_tp does not pipeline, but parallel.pp={dims.pp}: set parallel.pp=1")
        if dims.tp < 2:
            raise LayoutError(f"parallel=torch_tp needs parallel.tp >= 2 (got {dims.tp}): DTensor over one rank splits nothing")
        return
    if strategy in SHARDED and dims.world_size < 2:
        raise LayoutError(
            f"parallel={strategy} shards the model state over data-parallel ranks and needs at least 2 processes, "
            "got world size 1: launch it with torchrun --nproc-per-node 2 (or more)"
        )
    if strategy in ("pp", "tp", "3d"):
        return  # pp with tp > 1 and tp with pp > 1 were renamed 3d by build_plan
    if dims.tp != 1 or dims.pp != 1:
        raise LayoutError(
            f"parallel={strategy} is data parallel only, but parallel.tp={dims.tp} and parallel.pp={dims.pp}: "
            "set parallel.tp=1 parallel.pp=1, or use parallel=tp for tensor parallelism"
        )


def _check_steps(steps: int, warmup_steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"train.steps={steps!r} must be a positive integer")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < steps:
        raise ConfigError(
            f"train.warmup_steps={warmup_steps!r} must be at least 0 and below train.steps={steps}, "
            "so that some steps are timed: lower it or raise train.steps"
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(cfg) -> None:
    """Types and ranges of the numeric options that no layout rule covers (a string or a negative
    number must not reach torch as a traceback)."""
    t, p = cfg.train, cfg.parallel
    positive = [("train.lr", t.lr, "e.g. train.lr=0.001"), ("parallel.bucket_mb", p.bucket_mb, "PyTorch DDP uses 25"),
                ("parallel.timeout_s", p.timeout_s, "e.g. parallel.timeout_s=60")]
    for name, value, hint in positive:
        if not _is_number(value) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive number: {hint}")
    if not _is_number(t.weight_decay) or t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay={t.weight_decay!r} must be a number >= 0: e.g. train.weight_decay=0.1")
    for name, value, low in [("train.seed", t.seed, 0), ("data.max_bytes", cfg.data.max_bytes, 1),
                             ("parallel.virtual_stages", p.virtual_stages, 1), ("train.checkpoint_every", t.checkpoint_every, 0)]:
        if not _is_int(value) or value < low:
            raise ConfigError(f"{name}={value!r} must be an integer >= {low}")
    if t.threads is not None and (not _is_int(t.threads) or t.threads < 1):
        raise ConfigError(f"train.threads={t.threads!r} must be a positive integer, or null to share the cores among the ranks")
    for name, value in [("train.check_finite", t.check_finite), ("train.save_final", t.save_final), ("train.save_grads", t.save_grads),
                        ("parallel.sequence_parallel", p.sequence_parallel), ("comm.log", cfg.comm.log), ("comm.time", cfg.comm.time)]:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be true or false")


def _check_faults(t, world_size: int) -> None:
    """The fault-injection testing aid (parallel/faults.py): a mode, a step the run reaches, a rank that exists."""
    if t.fail_mode is None:
        return
    if t.fail_mode not in FAIL_MODES:
        raise ConfigError(f"train.fail_mode={t.fail_mode!r}: choose one of {', '.join(FAIL_MODES)}, or null (no fault)")
    last = t.steps if t.fail_mode == "kill_during_save" else t.steps - 1
    if not _is_int(t.fail_at_step) or not 0 <= t.fail_at_step <= last:
        raise ConfigError(f"train.fail_at_step={t.fail_at_step!r} must be a step this run reaches, 0 to {last}")
    if not _is_int(t.fail_rank) or not 0 <= t.fail_rank < world_size:
        raise ConfigError(f"train.fail_rank={t.fail_rank!r} must be a rank of this run, 0 to {world_size - 1}")
    if t.fail_mode == "kill_during_save":
        if t.fail_rank != 0:
            raise ConfigError("train.fail_mode=kill_during_save kills the checkpoint writer, which is rank 0: set train.fail_rank=0")
        if not t.checkpoint_every or t.fail_at_step % t.checkpoint_every or t.fail_at_step == 0:
            raise ConfigError(
                f"train.fail_mode=kill_during_save with train.fail_at_step={t.fail_at_step}: no checkpoint is saved after "
                f"{t.fail_at_step} steps (train.checkpoint_every={t.checkpoint_every}): use a multiple of checkpoint_every"
            )


def _resume_point(t, model: GPTConfig, cfg) -> tuple[str | None, int]:
    """The checkpoint to resume from and the step it continues at (or None, 0)."""
    if t.resume is None:
        return None, 0
    checkpoint = resolve_checkpoint(str(t.resume))
    plan_model = {k: getattr(model, k) for k in MODEL_KEYS}
    plan_data = {"seed": t.seed, "global_batch": t.global_batch, "data_path": cfg.data.path,
                 "data_max_bytes": cfg.data.max_bytes, "seq_len": model.seq_len}
    start = check_resumable(read_meta(checkpoint), plan_model, plan_data, t.steps, t.warmup_steps, str(t.resume))
    return str(checkpoint), start


def _check_pipeline(model: GPTConfig, dims: ParallelDims, p) -> None:
    """The layers must split into pp x virtual pieces and the schedule must accept (pp, m, v)."""
    if p.virtual_stages > 1 and dims.pp < 2:
        raise LayoutError(
            f"parallel.virtual_stages={p.virtual_stages} interleaves chunks across pipeline ranks, but parallel.pp={dims.pp}: "
            "use at least 2 pipeline ranks, or parallel.virtual_stages=1"
        )
    try:
        layer_counts(model.n_layers, dims.pp * p.virtual_stages, list(p.pp_layers) if p.pp_layers is not None else None)
        build_schedule(p.schedule, dims.pp, p.microbatches, p.virtual_stages)
    except (ScheduleError, SplitError) as e:
        raise ConfigError(str(e)) from None


def _check_3d_grad_sync(dims: ParallelDims, p) -> None:
    """The bucketed sync overlaps with the last microbatch's backward, which with one chunk per rank
    gives every local parameter its final gradient; with virtual stages a rank's chunks finish
    their last backward at different times, far apart in the schedule."""
    if dims.dp > 1 and p.grad_sync == "bucketed" and p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.grad_sync=bucketed overlaps the dp all-reduce with the last microbatch's backward, but with "
            f"parallel.virtual_stages={p.virtual_stages} a rank's chunks finish their backward at different times: "
            "set parallel.grad_sync=naive (or parallel.virtual_stages=1)"
        )


def _route_zero(strategy: str, zero, dims: ParallelDims) -> str:
    """parallel.zero picks how the dp dimension syncs. On a pure dp layout it is the zero<k>
    strategy; with tp or pp it is the 3d strategy (one code path, pp=1 or tp=1 included), whose dp
    sync becomes a ZeroOptimizer over the dp group. Refused where it means nothing."""
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ConfigError(f"parallel.zero={zero!r} is not a ZeRO stage: choose 0 (plain dp all-reduce), 1 or 2 "
                          "(3 only with parallel.tp=1 parallel.pp=1)")
    if zero == 0:
        return strategy
    if strategy not in ("dp", "tp", "pp", "3d"):
        raise ConfigError(
            f"parallel.zero={zero} sets the ZeRO stage of the dp dimension of parallel=dp, tp, pp or 3d, but "
            f"parallel={strategy} {'is a ZeRO stage already' if strategy in SHARDED else 'has no such dp sync'}: "
            "set parallel.zero=0"
        )
    if dims.dp < 2:
        raise LayoutError(
            f"parallel.zero={zero} shards over the data-parallel ranks, but parallel.dp={dims.dp} "
            f"(world {dims.world_size} = dp {dims.dp} x tp {dims.tp} x pp {dims.pp}): "
            "use at least 2 dp ranks, or parallel.zero=0"
        )
    if dims.tp == 1 and dims.pp == 1:
        return f"zero{zero}"
    if zero == 3:
        raise ConfigError(
            f"parallel.zero=3 does not compose with parallel.tp={dims.tp} parallel.pp={dims.pp} here: ZeRO-3 all-gathers "
            "each part's parameters before every microbatch's forward and again before its backward (2m gathers of "
            "every stage per step under a pipeline schedule, which wants m large), reduce-scatters gradients inside "
            "backward (before sequence parallelism's tp sum of partial gradients) and frees parameters that the tp and "
            "pp strategies read; use parallel.zero=1 or 2, or parallel=zero3 with parallel.tp=1 parallel.pp=1"
        )
    return "3d"


def _check_3d_zero(zero: int, sequence_parallel: bool, dims: ParallelDims, p) -> None:
    """ZeRO-2 reduce-scatters each part's gradients in backward hooks, as soon as the part has
    them, every microbatch: right only if those gradients are final for the microbatch there."""
    if zero != 2:
        return
    if sequence_parallel:
        raise ConfigError(
            "parallel.zero=2 with parallel.sequence_parallel=true: ZeRO-2 reduce-scatters each part's gradients over dp "
            "inside backward, but under sequence parallelism the LayerNorm and bias gradients are partial sums that are "
            "completed over tp only after backward; use parallel.zero=1 (it reduces after the tp sum) or "
            "parallel.sequence_parallel=false"
        )
    if p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.zero=2 with parallel.virtual_stages={p.virtual_stages}: ZeRO-2 reduces a microbatch's parts "
            "in backward order within one backward pass, but a rank's chunks run a microbatch's backward at "
            "different times of the interleaved schedule; use parallel.zero=1 (it reduces once after the schedule) "
            "or parallel.virtual_stages=1"
        )


def _check_precision(precision) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(
            f"train.precision={precision!r} is not one of {', '.join(PRECISIONS)}: use fp32 (the default, what the "
            "exact comparisons with the single run need) or bf16 (autocast with fp32 master weights)"
        )


def build_plan(cfg, env: LaunchEnv, cuda_available: bool) -> RunPlan:
    """Validate the whole configuration against the launch environment."""
    p, t = cfg.parallel, cfg.train
    _check_numbers(cfg)
    model = model_config(cfg.model)
    if model.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is below 256, but the data is byte-level (token ids 0..255): "
            "use model.vocab_size=256 (or more)"
        )
    dims = ParallelDims.resolve(env.world_size, dp=p.dp, tp=p.tp, pp=p.pp)
    strategy = p.name
    sequence_parallel = bool(p.sequence_parallel)
    # Tensor parallelism over one rank is data parallelism (sequence parallelism over one rank
    # cuts nothing), and `parallel=dp` (or pp) in one plain process is the single-process run.
    if strategy == "tp" and dims.tp == 1:
        strategy, sequence_parallel = "dp", False
    # A pipeline of tensor-parallel stages is one strategy, however it was asked for.
    if (strategy == "pp" and dims.tp > 1) or (strategy == "tp" and dims.pp > 1):
        strategy = "3d"
    zero = p.zero
    strategy = _route_zero(strategy, zero, dims)
    if strategy in ("dp", "pp", "3d") and env.world_size == 1:
        strategy = "single"
    _check_strategy(strategy, dims)
    if sequence_parallel and (strategy not in ("tp", "3d") or dims.tp == 1):
        raise ConfigError(
            f"parallel.sequence_parallel=true needs tensor parallelism, but parallel={strategy} with parallel.tp={dims.tp}: "
            "use parallel=tp_sp (with parallel.tp > 1) or set parallel.sequence_parallel=false"
        )
    if strategy in ("tp", "3d", "torch_tp"):
        dims.check_tensor_parallel(model, sequence_parallel)
    dims.check_batch(t.global_batch, p.microbatches)
    if strategy in ("pp", "3d", "torch_pp"):
        _check_pipeline(model, dims, p)
    if strategy == "3d":
        if zero:
            _check_3d_zero(zero, sequence_parallel, dims, p)  # the ZeroOptimizer replaces grad_sync
        else:
            _check_3d_grad_sync(dims, p)
    _check_steps(t.steps, t.warmup_steps)
    if p.grad_sync not in GRAD_SYNCS:
        raise ConfigError(f"parallel.grad_sync={p.grad_sync!r}: choose one of {', '.join(GRAD_SYNCS)}")
    _check_precision(t.precision)
    _check_faults(t, env.world_size)
    resume_from, start_step = _resume_point(t, model, cfg)
    backend = choose_backend(p.backend, cuda_available) if env.world_size > 1 else None
    return RunPlan(
        strategy=strategy,
        model=model,
        dims=dims,
        microbatches=p.microbatches,
        sequence_parallel=sequence_parallel,
        grad_sync=p.grad_sync,
        bucket_mb=float(p.bucket_mb),
        backend=backend,
        timeout_s=float(p.timeout_s),
        steps=t.steps,
        warmup_steps=t.warmup_steps,
        global_batch=t.global_batch,
        lr=float(t.lr),
        weight_decay=float(t.weight_decay),
        seed=int(t.seed),
        threads=t.threads,
        data_path=cfg.data.path,
        data_max_bytes=int(cfg.data.max_bytes),
        run_dir=cfg.run.dir,
        comm_log=bool(cfg.comm.log),
        comm_time=bool(cfg.comm.time),
        save_final=bool(t.save_final),
        save_grads=bool(t.save_grads),
        schedule=p.schedule,
        virtual_stages=p.virtual_stages,
        pp_layers=tuple(p.pp_layers) if p.pp_layers is not None else None,
        peak_flops=_peak_flops(t.get("peak_flops")),
        precision=t.precision,
        device_type=choose_device_type(p.backend, backend, cuda_available),
        zero=zero if strategy == "3d" else 0,  # on a pure dp layout the stage is in the strategy's name
        checkpoint_every=t.checkpoint_every,
        checkpoint_dir=t.checkpoint_dir,
        resume_from=resume_from,
        start_step=start_step,
        check_finite=t.check_finite,
        fail_mode=t.fail_mode,
        fail_at_step=t.fail_at_step,
        fail_rank=t.fail_rank,
    )


def _peak_flops(value) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"train.peak_flops={value!r} must be a positive number of FLOP/s per device, or null to measure it")
    return float(value)
