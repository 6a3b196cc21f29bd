"""Two published mixture-of-experts training runs, each predicted with its own configuration
(parallel/planner/moe_layouts.py: the planner's formulas on tp x pp x ep, which the sandbox cannot run):

  Mixtral 8x7B   Megatron-LM, megatron/core/transformer/moe/README.md (MCore v0.8): "Mixtral 8X7B bf16
                 training to achieve 438 TFLOPS", its reference mapping 64 H100s, sequences of 4096, TP 1,
                 EP 8, PP 4, VP 8 (one block per virtual stage), MBS 1, GBS 256, dropless, all-to-all dispatcher,
                 the distributed optimizer
  Mixtral 8x22B  NVIDIA's Megatron-MoE-ModelZoo, best_practice/Mixtral/run_mixtral_8x22B.sh: "Dropless
                 training, stable performance should be around 455TFLOPS for H100", with
                 runtime_configs/benchmarking/runtime.conf's Mixtral-8x22B row (TP 2, PP 8, EP 8, VPP 1, MBS 1,
                 GBS 256, 16 nodes, sequences of 4096) and model_configs/benchmarking/Mixtral-8x22B.yaml
                 (expert tensor parallelism 1, the distributed optimizer)

`python tests/tools/test_planner_moe_published.py` prints the table of docs/planner.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from launch.config import CONFIG_DIR  # noqa: E402
from parallel.core.shape import ModelShape  # noqa: E402
from parallel.dist.groups import LaunchEnv  # noqa: E402
from parallel.planner.cluster import cluster_from_config  # noqa: E402
from parallel.planner.moe_layouts import evaluate_moe_layout  # noqa: E402
from parallel.run_plan import build_plan  # noqa: E402

# (name, model preset, gpus, tp, pp, ep, virtual stages, global batch, expert tp, published TFLOP/s per GPU)
RUNS = [
    ("Mixtral 8x7B", "mixtral_8x7b", 64, 1, 4, 8, 8, 256, 1, 438.0),
    ("Mixtral 8x22B", "mixtral_8x22b", 128, 2, 8, 8, 1, 256, 1, 455.0),
]


def evaluate(run, cluster_name: str = "h100_sxm") -> dict:
    name, model, gpus, tp, pp, ep, v, batch, expert_tp, _ = run
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    overrides = [f"model={model}", "model.moe_experts=0", "parallel=3d", f"parallel.tp={tp}", f"parallel.pp={pp}",
                 f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}", "parallel.zero=1",
                 f"parallel.sequence_parallel={tp > 1}", f"train.global_batch={batch}",
                 f"parallel.microbatches={batch * tp * pp // gpus}", "train.recompute=none"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        plan_cfg = compose(config_name="plan", overrides=[f"cluster={cluster_name}", f"model={model}"])
    env = LaunchEnv(rank=0, world_size=gpus, local_rank=0, local_world_size=gpus)
    dense_plan = build_plan(cfg, env, cuda_available=False, planning=True)
    shape = ModelShape.from_preset(OmegaConf.to_container(plan_cfg.model, resolve=True))
    cluster = cluster_from_config(OmegaConf.to_container(plan_cfg.cluster, resolve=True), None, gpus)
    return evaluate_moe_layout(shape, dense_plan, ep, cluster, expert_tp)


def table() -> list[tuple[str, float, float, float, dict]]:
    out = []
    for run in RUNS:
        row = evaluate(run)
        published = run[-1]
        out.append((run[0], published, row["tflops_per_gpu"], row["tflops_per_gpu"] / published - 1, row))
    return out


def test_published_moe_runs_fit_and_are_timed():
    """Each run that happened fits in 80 GB in the planner's memory, and its TFLOP/s per GPU is predicted
    (the figures and their errors: docs/planner.md, printed by this file)."""
    for name, published, predicted, error, row in table():
        assert row["fits"], f"{name}: {row['memory']}"
        assert row["comm_s_by_group"]["ep"] > 0 and row["bubble_s"] > 0, name
        assert abs(error) < 0.25, f"{name}: predicted {predicted:.0f} TFLOP/s per GPU, published {published:.0f}"


if __name__ == "__main__":
    print("| run | GPUs | tp x pp x ep, vpp | published TFLOP/s/GPU | predicted | error | step s (compute / "
          "exposed comm / bubble) | memory GiB |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: |")
    for (name, published, predicted, error, row), run in zip(table(), RUNS):
        print(f"| {name} | {run[2]} | {run[3]} x {run[4]} x {run[5]}, {run[6]} | {published:.0f} | {predicted:.0f} | "
              f"{100 * error:+.1f}% | {row['step_s']:.2f} ({row['compute_s']:.2f} / {row['exposed_comm_s']:.2f} / "
              f"{row['bubble_s']:.2f}) | {row['memory']['total'] / 2**30:.1f} |")
