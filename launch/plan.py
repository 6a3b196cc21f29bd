"""Will it fit? What will it wait on? Which layout wins? Every valid layout of N devices, predicted.

    python -m launch.plan model=llama3_70b cluster=h100_sxm plan.world=64 plan.global_batch=512
    python -m launch.plan model=llama3_405b cluster=h100_sxm plan.world=16384 plan.global_batch=2048
    python -m launch.plan model=small plan.world=4 'plan.layouts=[dp,tp,pp_1f1b,zero3,3d]' plan.validate=true
    python -m launch.plan model=llama3_70b cluster=h100_sxm plan.world=64 plan.global_batch=512 \
        parallel=3d parallel.tp=8 parallel.pp=4 parallel.microbatches=32 train.recompute=full

With `parallel=<preset>` (and any parallel.* or train.recompute override launch.train takes) it
evaluates that one layout, no search (parallel/planner/one.py): the row and its breakdown.

For each layout that run_plan.py accepts (parallel/planner/enumerate.py), memory per device by kind
(parallel/planner/memory.py), bytes per step inside and between nodes (the families' closed forms, split by
parallel/planner/links.py), and step time as compute, exposed communication and bubble
(parallel/planner/timing.py); ranked, fits first. Writes plan.json, report.md and two plots to
`run.dir` (default runs/<time>-plan-<model>-<cluster>-w<world>) and prints the table. With
plan.validate=true it runs the best layouts (and any plan.layouts names) here and adds what they
measured (parallel/planner/validate.py).

A configuration error is one `error:` line and exit status 2.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import hydra
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launch.config import CONFIG_DIR
from parallel.core.shape import ModelShape, ShapeError
from parallel.dist.dims import LayoutError
from parallel.planner import plots
from parallel.planner.cluster import GIB, ClusterError, cluster_from_config
from parallel.planner.enumerate import Enumeration, Space
from parallel.planner.one import breakdown, evaluate_layout
from parallel.planner.report import console_table, write_json, write_markdown
from parallel.planner.search import Preset, plan_rows
from parallel.planner.timing import ASSUMPTIONS
from parallel.planner.validate import (
    ValidationError,
    calibrate,
    choose,
    order_agreement,
    run_settings,
    validate_rows,
)
from parallel.registry import parse_options
from parallel.run_plan import ConfigError

PLAN_ERRORS = (ConfigError, LayoutError, ShapeError, ClusterError, ValidationError)


def load_presets() -> list[Preset]:
    """Every conf/parallel/ preset, composed as launch.train composes it (defaults included)."""
    presets = []
    for path in sorted((Path(CONFIG_DIR) / "parallel").glob("*.yaml")):
        p = compose(config_name="config", overrides=[f"parallel={path.stem}"]).parallel
        presets.append(Preset(path.stem, p.name, parse_options(p)))
    return presets


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


def _cluster(cfg: DictConfig, world: int):
    """The cluster preset, on the emulated network where one is given, with plan.* overrides."""
    p = cfg.plan
    net = OmegaConf.to_container(cfg.net, resolve=True) if "net" in cfg else None
    cluster = cluster_from_config(OmegaConf.to_container(cfg.cluster, resolve=True), net, world)
    changes = {k: v for k, v in (("precision", p.precision), ("efficiency", p.efficiency),
                                 ("peak_flops", p.peak_tflops and float(p.peak_tflops) * 1e12)) if v}
    return replace(cluster, **changes)


def _space(p, shape: ModelShape, cluster) -> Space:
    space = Space(**OmegaConf.to_container(p.search, resolve=True))
    if space.get("context_parallel") is None:
        # Under context parallelism every kind's saved bytes have a formula in fp32
        # (activations.activation_bytes); in bf16 only the ring's (memory.py), so by default a bf16 search
        # leaves cp out rather than show the all-to-all's rows as "?"; meta.search says so.
        # Recomputation is searched: memory.py holds what a Megatron-style implementation saves under each mode.
        space = Space(**{**space, "context_parallel": cluster.precision == "fp32"})
    return space


def main_plan(cfg: DictConfig) -> Path:
    p = cfg.plan
    world = positive_int("plan.world", p.world)
    global_batch = positive_int("plan.global_batch", p.global_batch or cfg.train.global_batch)
    choices = HydraConfig.get().runtime.choices
    model_name, cluster_name = choices.get("model"), choices.get("cluster")
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    net = OmegaConf.to_container(cfg.net, resolve=True) if "net" in cfg else None
    cluster = _cluster(cfg, world)
    base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    presets = load_presets()
    space = _space(p, shape, cluster)
    layouts, keep = (list(p.layouts) if p.layouts is not None else None), max(p.top, p.validate_top)
    if cfg.get("parallel") is not None:
        return _one_layout(cfg, shape, base, presets, cluster, world, global_batch, model_name, cluster_name)
    started = time.perf_counter()
    rows, found = plan_rows(shape, base, presets, cluster, world, global_batch, space, layouts, keep)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir or Path("runs") / f"{stamp}-plan-{model_name}-{cluster_name}-w{world}")
    run_dir.mkdir(parents=True, exist_ok=True)
    validation, calibration = None, None
    if p.validate:
        settings = run_settings([f"model={model_name}", *_model_field_overrides(cfg)], p.steps, p.warmup_steps,
                                cluster.peak_flops)
        recalibrate = None
        if p.calibrate == "each":
            def recalibrate(row: dict, name: str) -> dict:
                efficiency, single = calibrate(settings, global_batch, world, run_dir, p.timeout_s, f"{name}-single")
                again, _ = plan_rows(shape, base, presets, replace(cluster, efficiency=efficiency), world,
                                     global_batch, space, layouts)
                fresh = next(r for r in again if r["run_overrides"] == row["run_overrides"])
                return {**fresh, "rank": row["rank"], "calibration": {"efficiency": efficiency,
                                                                      "step_time_s": single["step_time_s"]}}
        elif p.calibrate:
            efficiency, single = calibrate(settings, global_batch, world, run_dir, p.timeout_s)
            calibration = {"efficiency": efficiency, "step_time_s": single["step_time_s"], "from": "parallel=single"}
            print(f"calibration: parallel=single reaches {efficiency:.1%} of its cores' peak; predicting with it",
                  flush=True)
            cluster = replace(cluster, efficiency=efficiency)
            rows, found = plan_rows(shape, base, presets, cluster, world, global_batch, space, layouts, keep)
        validation = choose(rows, p.validate_top, layouts)
        net_preset = choices.get("net")
        validate_rows(validation, settings, world, run_dir, net, net_preset, p.timeout_s, recalibrate=recalibrate)
    meta = _meta(cfg, model_name, shape, cluster, world, global_batch, found, space, time.perf_counter() - started)
    if validation is not None:
        own_net = cfg.cluster.get("net")
        meta["validation"] = {"calibration": calibration, "command_net": choices.get("net") or "none",
                              "net": net or (OmegaConf.to_container(own_net) if own_net is not None else None),
                              **order_agreement(validation)}
    _write_plan(run_dir, meta, rows, validation, cluster, p.top)
    print(_verdict(model_name, world, cluster, rows, found, keep))
    print(console_table(rows, p.top))
    if validation is not None:
        _print_validation(validation, meta["validation"], choices.get("net"))
    print(f"\nplan.json, report.md, memory_per_device.png, step_time.png in {run_dir}")
    return run_dir


def _verdict(model_name: str, world: int, cluster, rows: list[dict], found, keep: int) -> str:
    """The one-line answer above the table: what was kept, what fits, and what the search did not ask."""
    fit = sum(1 for r in rows if r["fits"])
    return (f"{model_name} on {world} x {cluster.name}: {len(rows)} valid layouts kept, {fit} that fit in "
            f"{cluster.usable_bytes / GIB:.1f} GiB usable per device (the fastest {keep} exactly the search's best) "
            f"and {len(rows) - fit} over it ({found.requests} requests, {sum(found.refused.values())} refused by "
            f"run_plan.py; not asked: {found.pruned} whose model state alone is over the device, {found.heavy} whose "
            f"first pipeline rank's memory floor is over it, {found.bounded} whose step-time floor is over the top "
            f"{keep})")


def _write_plan(run_dir: Path, meta: dict, rows: list[dict], validation, cluster, top: int) -> None:
    """plan.json, report.md and the two plots of the rows shown (or the validated ones)."""
    shown = rows[:top]
    plots.memory_plot(shown, cluster.usable_bytes, cluster.memory_bytes, run_dir / "memory_per_device.png")
    plots.time_plot(validation or shown, run_dir / "step_time.png")
    write_json(run_dir / "plan.json", meta, rows)
    write_markdown(run_dir / "report.md", meta, rows, top, ["memory_per_device.png", "step_time.png"], validation)


def _print_validation(validation: list[dict], order: dict, net_preset: str | None) -> None:
    from parallel.planner.report import markdown_validation

    print("\nvalidation (predicted against measured, net=" + str(net_preset or "none") + "):")
    print(markdown_validation(validation))
    print(f"fastest first, predicted: {order['predicted_order']}; measured: {order['measured_order']} "
          f"({'the same' if order['same'] else 'not the same'})")


def _one_layout(cfg, shape, base, presets, cluster, world, global_batch, model_name, cluster_name) -> Path:
    """parallel=<preset>: this one layout's row, printed with its breakdown and written as a one-row plan."""
    started = time.perf_counter()
    parallel = OmegaConf.to_container(cfg.parallel, resolve=True)
    recompute = cfg.train.get("recompute")
    row = evaluate_layout(shape, base, presets, cluster, world, global_batch, parallel, recompute,
                          cfg.plan.get("microbatch_size"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir or Path("runs") / f"{stamp}-plan-{model_name}-{cluster_name}-w{world}-one")
    run_dir.mkdir(parents=True, exist_ok=True)
    found = Enumeration([], Counter(), 1)
    meta = _meta(cfg, model_name, shape, cluster, world, global_batch, found, Space(), time.perf_counter() - started)
    meta["one_layout"] = True
    write_json(run_dir / "plan.json", meta, [row])
    print(f"{model_name} on {world} x {cluster.name}: one layout")
    print(console_table([row], 1))
    print(breakdown(row, cluster.usable_bytes))
    print(f"\nplan.json in {run_dir}")
    return run_dir


def _model_field_overrides(cfg: DictConfig) -> list[str]:
    """The resolved model fields, so a run builds exactly the model planned (model.n_layers=2 included)."""
    return [f"model.{k}={v}" for k, v in OmegaConf.to_container(cfg.model, resolve=True).items()]


def _meta(cfg, model_name, shape: ModelShape, cluster, world, global_batch, found, space, seconds) -> dict:
    g = shape.gpt
    differences = shape.differences()
    return {
        "model": {"preset": model_name, **OmegaConf.to_container(cfg.model, resolve=True),
                  "parameters": shape.parameter_count(), "flops_per_token": shape.flops_per_token(),
                  "seq_len": g.seq_len,
                  "description": "; ".join(differences) if differences else "the sandbox GPT",
                  "differs_from_sandbox_gpt": differences},
        "cluster": {**{k: v for k, v in cluster.__dict__.items()}, "usable_gib": cluster.usable_bytes / GIB},
        "world": world, "global_batch": global_batch, "tokens_per_step": global_batch * g.seq_len,
        "precision": cluster.precision,
        "assumptions": {**ASSUMPTIONS, **MEMORY_ASSUMPTIONS, "bytes": BYTES_ASSUMPTION},
        "search": dict(space), "requests": found.requests, "refused": dict(found.refused),
        "refused_total": sum(found.refused.values()), "pruned": found.pruned, "heavy": found.heavy,
        "bounded": found.bounded,
        "seconds": seconds,
    }


MEMORY_ASSUMPTIONS = {
    "model state": "per parameter fp32: 4 + 4 + 8 bytes; bf16 mixed precision: 2 (weights) + 2 (gradients) + 12 "
                   "(fp32 master and Adam's moments); ZeRO-k shards them over dp, each part padded to a multiple of dp",
    "activations": "in fp32 with flash attention, what the model's ops save for backward (parallel/activations.py: "
                   "GPT-2's block or Llama's, the formula every run's meter is held to), per microbatch in flight on "
                   "the rank (the schedule's lists); in bf16 or with materialized attention (flash_attention: false) "
                   "as a Megatron-style implementation holds them, the loss in fp32, with the s x s attention scores "
                   "where they are materialized",
    "buffers": "the last stage's fp32 logits, a tp region's summed copy, ZeRO-2/3's one gathered or unsharded part",
    "fits": "memory of the rank that holds the most <= (capacity - runtime) x (1 - headroom)",
}
BYTES_ASSUMPTION = ("the closed forms per group (the registry's comm), split between links by how each group's "
                    "ranks sit on nodes (tp innermost); a tied head over several stages adds its copy's gradient to "
                    "the dp bytes and its all-reduce to the pipeline's")


@hydra.main(config_path=CONFIG_DIR, config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        main_plan(cfg)
    except PLAN_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
