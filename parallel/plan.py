"""From the Hydra config to a validated run plan, before any process group exists.

Everything that can be wrong with a configuration is caught here, on every rank, from the config
and the torchrun environment alone. A wrong value ends in one sentence that names it, the rule it
breaks and a fix, and a non-zero exit: never a hang inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dims import LayoutError, ParallelDims
from .distributed import LaunchEnv, choose_backend
from .model import GPTConfig
from .pp.schedules import ScheduleError, build_schedule
from .pp.split import SplitError, layer_counts

# Strategy name -> what it needs of the layout. Later strategies add themselves here.
STRATEGIES = ("single", "dp", "torch_ddp", "tp", "pp", "torch_tp", "torch_pp", "accelerate_ddp")
GRAD_SYNCS = ("bucketed", "naive")


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
    if strategy == "pp":
        if dims.tp != 1:
            raise LayoutError(f"parallel=pp does not combine with tensor parallelism yet: set parallel.tp=1 (got {dims.tp})")
        return
    if strategy == "tp":
        if dims.pp != 1:
            raise LayoutError(
                f"parallel=tp does not pipeline, but parallel.pp={dims.pp}: set parallel.pp=1 "
                "(the world is split into dp x tp)"
            )
        return
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


def build_plan(cfg, env: LaunchEnv, cuda_available: bool) -> RunPlan:
    """Validate the whole configuration against the launch environment."""
    p, t = cfg.parallel, cfg.train
    model = model_config(cfg.model)
    dims = ParallelDims.resolve(env.world_size, dp=p.dp, tp=p.tp, pp=p.pp)
    strategy = p.name
    sequence_parallel = bool(p.sequence_parallel)
    # Tensor parallelism over one rank is data parallelism (sequence parallelism over one rank
    # cuts nothing), and `parallel=dp` (or pp) in one plain process is the single-process run.
    if strategy == "tp" and dims.tp == 1:
        strategy, sequence_parallel = "dp", False
    if strategy in ("dp", "pp") and env.world_size == 1:
        strategy = "single"
    _check_strategy(strategy, dims)
    if sequence_parallel and strategy != "tp":
        raise ConfigError(
            f"parallel.sequence_parallel=true needs tensor parallelism, but parallel={strategy}: "
            "use parallel=tp_sp (with parallel.tp > 1) or set parallel.sequence_parallel=false"
        )
    if strategy in ("tp", "torch_tp"):
        dims.check_tensor_parallel(model, sequence_parallel)
    dims.check_batch(t.global_batch, p.microbatches)
    if strategy in ("pp", "torch_pp"):
        _check_pipeline(model, dims, p)
    _check_steps(t.steps, t.warmup_steps)
    if p.grad_sync not in GRAD_SYNCS:
        raise ConfigError(f"parallel.grad_sync={p.grad_sync!r}: choose one of {', '.join(GRAD_SYNCS)}")
    if not p.bucket_mb > 0:
        raise ConfigError(f"parallel.bucket_mb={p.bucket_mb!r} must be a positive number of MiB (PyTorch DDP uses 25)")
    if not p.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s={p.timeout_s!r} must be a positive number of seconds")
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
    )


def _peak_flops(value) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"train.peak_flops={value!r} must be a positive number of FLOP/s per device, or null to measure it")
    return float(value)
