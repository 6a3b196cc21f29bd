"""One fully specified layout, evaluated: "what would my config do", without the search.

`python -m launch.plan ... parallel=3d parallel.tp=8 parallel.pp=2 parallel.microbatches=64
train.recompute=full` takes the same overrides launch.train takes (a conf/parallel/ preset and its
parallel.* fields, train.recompute); dp is what the world leaves, as launch.train derives it. The
layout goes through `parallel.run_plan.build_plan` (the same refusals a run would meet, one `error:`
line) and parallel/planner/predict.py, and comes back as the one row a search would have ranked,
printed with its memory and time breakdown (`breakdown`).
"""

from __future__ import annotations

from parallel.core.shape import ModelShape
from parallel.dist.dims import SIZES, LayoutError
from parallel.dist.groups import LaunchEnv
from parallel.planner.cluster import GIB, Cluster
from parallel.planner.enumerate import Config, candidate_of, shape_rule
from parallel.planner.predict import predict_row
from parallel.planner.search import Preset, preset_for, run_overrides
from parallel.registry import parse_options, request_fields
from parallel.run_plan import ConfigError, build_plan


def evaluate_layout(shape: ModelShape, base: dict, presets: list[Preset], cluster: Cluster, world: int,
                    global_batch: int, parallel: dict, recompute: str | None = None,
                    microbatch_size: int | None = None) -> dict:
    """The row of this one layout (`parallel`: the composed parallel.* section of a training config)."""
    parallel = dict(parallel)
    recompute = recompute if recompute is not None else base["train"].get("recompute")
    if microbatch_size is not None:
        sizes = [parallel.get(k) or 1 for k in ("tp", "pp", "cp")]
        dp = parallel.get("dp") or world // (sizes[0] * sizes[1] * sizes[2])
        if global_batch % (dp * microbatch_size):
            raise ConfigError(f"plan.microbatch_size={microbatch_size} does not divide the local batch "
                              f"{global_batch}/{dp} (train.global_batch / dp)")
        parallel["microbatches"] = global_batch // (dp * microbatch_size)
    model = {k: getattr(shape.gpt, k) for k in base["model"] if hasattr(shape.gpt, k)}
    train = {**base["train"], "global_batch": global_batch, **({"recompute": recompute} if recompute else {})}
    config = Config({**base, "model": model, "train": train, "parallel": {**base["parallel"], **parallel}})
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    plan = build_plan(config, env, cuda_available=False, planning=True)
    why = shape_rule(shape, plan)
    if why:
        raise ConfigError(why)
    request = {k: parallel[k] for k in (*SIZES, "microbatches") if parallel.get(k) is not None}
    request.update(request_fields(parse_options(parallel)))
    if recompute is not None:
        request["recompute"] = recompute
    candidate = candidate_of(parallel["name"], plan, request)
    preset = preset_for(candidate, presets)
    row = predict_row(shape, candidate, cluster, preset)
    row["run_overrides"] = run_overrides(candidate, preset, presets)
    row["rank"] = 1
    cut = candidate.layout.cut()
    if row["fits"] is False and cut.sequence_parallel and not cut.saves_shard:
        row["notes"] += _piece_saved(shape, base, cluster, world, global_batch, parallel, recompute)
    return row


def _piece_saved(shape: ModelShape, base: dict, cluster: Cluster, world: int, global_batch: int, parallel: dict,
                 recompute: str | None) -> list[str]:
    """Under sequence parallelism the column-parallel linears save the all-gathered input here (the project's
    default, parallel.tp_saves=gathered); Megatron-LM's save the sequence piece. Where saving the piece fits,
    say so: a published Megatron run's layout is refused otherwise."""
    try:
        row = evaluate_layout(shape, base, [], cluster, world, global_batch, {**parallel, "tp_saves": "sharded"},
                              recompute)
    except (ConfigError, LayoutError):  # the piece is not saved on this layout (e.g. under context parallelism)
        return []
    if not row["fits"]:
        return []
    return [f"fits with parallel.tp_saves=sharded ({row['memory_bytes_per_device']['total'] / GIB:.1f} GiB): the "
            "column-parallel linears keep their sequence piece, as Megatron-LM's sequence parallelism does"]


def breakdown(row: dict, usable_bytes: float) -> str:
    """The row's memory by kind and its step by part, one figure a line."""
    m, t = row["memory_bytes_per_device"], row["step_time_s"]
    lines = ["memory per device (the rank that holds the most), GiB:"]
    for k in ("params", "grads", "optimizer", "activations", "buffers", "total"):
        v = m.get(k)
        lines.append(f"  {k:<12} {'?' if v is None else f'{v / GIB:.2f}'}")
    lines.append(f"  usable       {usable_bytes / GIB:.2f}  fits: {row['fits']}")
    if t:
        lines.append("step time, s:")
        for k in ("compute", "exposed_comm", "bubble", "total"):
            lines.append(f"  {k:<12} {t[k]:.4g}")
        if t.get("codec"):
            lines.append(f"    compute.codec          {t['codec']:.4g} (lossy collectives, DiLoCo's outer step)")
        if t.get("optimizer"):
            lines.append(f"    compute.optimizer      {t['optimizer']:.4g} (the optimizer step)")
        if t.get("copies"):
            lines.append(f"    compute.copies         {t['copies']:.4g} (ZeRO's and FSDP2's copies around collectives)")
        for k, v in (row.get("compute_s") or {}).items():
            lines.append(f"    compute.{k:<14} {v:.4g}")
        for k, v in (row.get("comm_seconds_by_group") or {}).items():
            lines.append(f"    comm.{k:<6} {v:.4g} (per step, exposed or not)")
        lines.append(f"  MFU (model FLOPs / peak)    {row['mfu']:.1%}")
        if row.get("hfu") is not None:
            lines.append(f"  HFU (hardware FLOPs / peak) {row['hfu']:.1%}")
    lines += [f"  note: {n}" for n in row["notes"]]
    lines.append("run it: " + " ".join(row["run_overrides"]))
    return "\n".join(lines)
