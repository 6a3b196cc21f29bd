"""The planner against published training runs: Megatron-LM's weak scaling (Narayanan et al. 2021, SC21,
arXiv 2104.04473, Table 1), each of its ten layouts evaluated in launch.plan's one-layout mode.

Table 1 gives the model, tp, pp, the GPUs and the global batch (s 2048, V 51,200, A100 80GB, the
interleaved schedule, full recomputation). What it leaves out is assumed, as docs/planner.md says:
microbatch size 1; v model chunks per pipeline rank, the fewest (above one) its blocks split into
evenly (2, 3 for 76.1B's and 529.6B's 15 and 3 blocks per stage); no dropout (its masks are 2 of 34 units);
dp's all-reduce after the backward (grad_sync=naive: Megatron of 2021 did not overlap it); no
sequence parallelism (it came in 2022). The paper's TFLOP/s count F = 96·B·s·l·h²·(1 + s/6h + V/16lh),
the recomputed forward included: predicted TFLOP/s per GPU = F / (GPUs x predicted step).
"""

from __future__ import annotations

import statistics

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launch.config import CONFIG_DIR
from parallel.core.shape import ModelShape
from parallel.planner.cluster import cluster_from_config
from parallel.planner.one import evaluate_layout

# params, heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
S, V = 2048, 51200


def paper_flops(batch: int, layers: int, h: int) -> float:
    return 96 * batch * S * layers * h**2 * (1 + S / (6 * h) + V / (16 * layers * h))


def chunks(blocks_per_stage: int) -> int:
    """The assumed v: the fewest chunks (more than one) a stage's blocks split into evenly."""
    return next(v for v in range(2, blocks_per_stage + 1) if blocks_per_stage % v == 0)


def evaluate(row, cluster_name: str = "a100_80gb") -> dict:
    name, heads, h, layers, tp, pp, gpus, batch, _ = row
    model = [f"model.n_layers={layers}", f"model.d_model={h}", f"model.n_heads={heads}", f"model.vocab_size={V}",
             f"model.seq_len={S}"]
    v = 1 if pp == 1 else chunks(layers // pp)
    parallel = [f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.grad_sync=naive",
                f"parallel.schedule={'interleaved_1f1b' if pp > 1 else '1f1b'}", f"parallel.virtual_stages={v}",
                f"parallel.microbatches={batch // (gpus // (tp * pp))}", "train.recompute=full"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=["model=gpt2_1p5b", f"cluster={cluster_name}", "parallel=3d",
                                                     *model, *parallel])
        base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    cluster = cluster_from_config(OmegaConf.to_container(cfg.cluster, resolve=True), None, gpus)
    out = evaluate_layout(shape, base, [], cluster, gpus, batch, OmegaConf.to_container(cfg.parallel, resolve=True),
                          "full")
    step = out["step_time_s"]["total"]
    return {"row": out, "step_s": step, "tflops": paper_flops(batch, layers, h) / gpus / step / 1e12,
            "usable": cluster.usable_bytes}


def table() -> list[tuple[str, float, float, float]]:
    """(params, published, predicted, error) for every row."""
    out = []
    for row in TABLE_1:
        got = evaluate(row)
        out.append((row[0], row[-1], got["tflops"], got["tflops"] / row[-1] - 1))
    return out


# Known misses (docs/planner.md): tp 4 and 8 without a pipeline, where the model makes the unsharded
# elementwise ops (no sequence parallelism) and the exposed dp all-reduce of 2021's Megatron too slow.
MISSES = {"7.5B", "18.4B"}


def marked(row):
    reason = "predicted >15% slow: tp without pp (docs/planner.md, where the model misses)"
    return pytest.param(row, id=row[0], marks=pytest.mark.xfail(strict=True, reason=reason)) if row[0] in MISSES \
        else pytest.param(row, id=row[0])


def test_every_published_layout_fits():
    for row in TABLE_1:
        got = evaluate(row)
        assert got["row"]["fits"] is True, (row[0], got["row"]["memory_bytes_per_device"])


@pytest.mark.parametrize("row", [marked(r) for r in TABLE_1])
def test_published_layout_throughput_is_within_15_percent(row):
    got = evaluate(row)
    assert got["tflops"] == pytest.approx(row[-1], rel=0.15), (got["tflops"], got["row"]["step_time_s"])


if __name__ == "__main__":
    rows = table()
    for name, published, predicted, error in rows:
        print(f"| {name} | {published} | {predicted:.1f} | {error:+.1%} |")
    errors = [abs(e) for *_, e in rows]
    print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}")
