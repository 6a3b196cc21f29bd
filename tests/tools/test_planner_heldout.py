"""The planner against every published run of tests/tools/published_runs.py, each evaluated in launch.plan's
one-layout mode with the run's own configuration; the held-out rows (no parameter chosen on them) must be
predicted within 15%, their median within 10%, and none refused as not fitting.

`python tests/tools/test_planner_heldout.py` prints the fitted and the held-out table (docs/planner.md's
"Published runs"); `--fit h100_sxm` first bisects that preset's `efficiency` on its FIT row;
`--what-if-micro 2 MT-NLG` prints only the rows whose names start with MT-NLG, run with microbatches of 2
instead of their encoding (a check, no change).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from published_runs import FIT, HELD_OUT, IN_SAMPLE, Run, all_runs

from launch.config import CONFIG_DIR
from parallel.core.shape import ModelShape
from parallel.dist.dims import LayoutError
from parallel.planner.cluster import cluster_from_config
from parallel.planner.one import evaluate_layout
from parallel.run_plan import ConfigError

RUNS = all_runs()
HELD = [r for r in RUNS if r.split == HELD_OUT]

# What the planner does not yet predict, and why (docs/planner.md, "Published runs"). A time miss is held
# within 25% instead of 15%; a memory miss (none now) is a strict expected failure (one that starts to fit
# fails its test until it is taken off the list).
TIME_MISSES = {
    "MT-NLG 530B, 420 nodes": ("slower than predicted by about as much a step at 280, 350 and 420 nodes: its "
                               "published times fit a bubble of 2(p - 1) sequences, microbatches of 2 (the paper "
                               "does not say; the row keeps the 1 it was encoded with before any prediction; "
                               "--what-if-micro 2 MT-NLG gives +1.6-2.7%)"),
}
MEMORY_MISSES: dict[str, str] = {}


def source_flops(run: Run) -> float:
    """The run's FLOPs per step as its source counts them: Megatron's 96·B·s·l·h²(1 + s/6h + V/16lh)."""
    m, b = run.model, run.batch
    s, h, layers, v = m["seq_len"], m["d_model"], m["n_layers"], m["vocab_size"]
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def compose_run(run: Run):
    """The composed plan config and training base of `run` (as launch.plan builds them from overrides)."""
    model = [f"model.{k}={v}" for k, v in run.model.items() if k != "preset"]
    parallel = [f"parallel.{k}={v}".replace(" ", "") for k, v in run.parallel.items()]
    cluster = [f"cluster.{k}={v}" for k, v in run.cluster_overrides.items()]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=[f"model={run.model['preset']}", f"cluster={run.cluster}",
                                                     "parallel=3d", *model, *parallel, *cluster,
                                                     f"train.recompute={run.recompute}"])
        base = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    base.update({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train", "data")})
    return cfg, base


def evaluate(run: Run, efficiency: float | None = None) -> dict:
    """The one-layout row of `run` and its prediction in the source's unit (`predicted`), or `refused`."""
    cfg, base = compose_run(run)
    shape = ModelShape.from_preset(OmegaConf.to_container(cfg.model, resolve=True))
    cluster = cluster_from_config(OmegaConf.to_container(cfg.cluster, resolve=True), None, run.gpus)
    if efficiency is not None:
        cluster = replace(cluster, efficiency=efficiency)
    try:
        row = evaluate_layout(shape, base, [], cluster, run.gpus, run.batch,
                              OmegaConf.to_container(cfg.parallel, resolve=True), run.recompute, run.micro)
    except (ConfigError, LayoutError) as e:
        return {"refused": str(e)}
    step = row["step_time_s"]["total"]
    if run.metric == "step_s":
        predicted = step
    elif run.flops == "planner":
        # the planner's hardware FLOPs: its model FLOPs with the attention core, as a run without
        # recomputation does them (`mfu` counts 6 per parameter and token only)
        predicted = row["hfu"] * cluster.peak_flops / 1e12
    else:
        predicted = source_flops(run) / run.gpus / step / 1e12
    # positive: the planner predicts a faster step than the run had
    error = run.published / predicted - 1 if run.metric == "step_s" else predicted / run.published - 1
    return {"row": row, "fits": row["fits"], "predicted": predicted, "error": error}


def fit_efficiency(cluster: str) -> float:
    """The efficiency at which the cluster's FIT row is predicted exactly (bisection: faster with more)."""
    run = next(r for r in RUNS if r.cluster == cluster and r.split == FIT)
    lo, hi = 0.05, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if evaluate(run, mid)["error"] > 0 else (mid, hi)
    return (lo + hi) / 2


_SEEN: dict = {}


def evaluated(run: Run) -> dict:
    """`evaluate` with the preset's own efficiency, once per run (several tests read each)."""
    if run.name not in _SEEN:
        _SEEN[run.name] = evaluate(run)
    return _SEEN[run.name]


def table(runs: list[Run]) -> list[str]:
    lines = ["| run | cluster | source | layout | published | predicted | error | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        got, p = evaluated(run), run.parallel
        layout = (f"{run.gpus} GPUs, tp {p.get('tp', 1)} pp {p.get('pp', 1)} cp {p.get('cp', 1)}, "
                  f"B {run.batch} b {run.micro}, {run.recompute}")
        fmt, unit = {"tflops": (".0f", "TFLOP/s"), "step_s": (".2f", "s/step")}[run.metric]
        head = f"| {run.name} | {run.cluster} | {run.source.split(',')[0]} | {layout} | {run.published:{fmt}} {unit} |"
        if "refused" in got:
            lines.append(f"{head} refused: {got['refused']} | | |")
        else:
            lines.append(f"{head} {got['predicted']:{fmt}} | {got['error']:+.1%} | {got['fits']} |")
    return lines


def known(misses: dict, runs: list[Run]) -> list:
    """`runs` as test parameters, those in `misses` expected to fail (strictly: one that passes fails)."""
    return [pytest.param(r, id=r.name, marks=[pytest.mark.xfail(strict=True, reason=misses[r.name])]
                         if r.name in misses else []) for r in runs]


@pytest.mark.parametrize("run", HELD, ids=lambda r: r.name)
def test_held_out_run_is_predicted_within_15_percent(run):
    """Within 15%; a listed miss (TIME_MISSES, each with its reason, in docs/planner.md) within 25%, so that
    it is still held where it stands and a row that drifts past its listed bound fails."""
    got = evaluated(run)
    assert "refused" not in got, got
    bound = 0.25 if run.name in TIME_MISSES else 0.15
    assert abs(got["error"]) <= bound, (run.name, got["predicted"], run.published, got["row"]["step_time_s"])


@pytest.mark.parametrize("run", known(MEMORY_MISSES, HELD))
def test_held_out_run_fits(run):
    got = evaluated(run)
    assert got.get("fits") is True, (run.name, got.get("refused") or got["row"]["memory_bytes_per_device"])


def test_held_out_median_error_is_within_10_percent():
    errors = [abs(evaluated(r).get("error", 1.0)) for r in HELD]
    assert statistics.median(errors) <= 0.10, sorted(errors)


@pytest.mark.parametrize("run", [r for r in RUNS if r.split == FIT], ids=lambda r: r.cluster)
def test_each_fit_run_is_reproduced_by_its_presets_efficiency(run):
    """The preset's `efficiency` is the bisection's figure (refit with --fit after a time-model change)."""
    assert evaluated(run)["error"] == pytest.approx(0, abs=0.01)


def test_at_least_a_third_of_the_runs_are_held_out_one_fit_per_cluster_and_every_row_sourced():
    assert len(HELD) * 3 >= len(RUNS)
    fits = [r.cluster for r in RUNS if r.split == FIT]
    assert len(fits) == len(set(fits))
    assert all(r.source and r.sure for r in RUNS) and len({r.name for r in RUNS}) == len(RUNS)


if __name__ == "__main__":
    import sys

    if "--fit" in sys.argv:
        name = sys.argv[sys.argv.index("--fit") + 1]
        print(f"efficiency of {name} fitted on its FIT row: {fit_efficiency(name):.4f}")
    if "--what-if-micro" in sys.argv:  # a check on rows whose microbatch was assumed, never a change to them
        i = sys.argv.index("--what-if-micro")
        micro, prefix = int(sys.argv[i + 1]), sys.argv[i + 2]
        print(f"\nWhat if the rows named {prefix}* ran microbatches of {micro} (not their encoding)\n")
        print("\n".join(table([replace(r, name=f"{r.name}, b {micro}", micro=micro)
                               for r in RUNS if r.name.startswith(prefix)])))
        sys.exit(0)
    for title, split in (("Fitted (FIT and IN_SAMPLE)", (FIT, IN_SAMPLE)), ("Held out", (HELD_OUT,))):
        print(f"\n{title}\n")
        print("\n".join(table([r for r in RUNS if r.split in split])))
    errors = [abs(evaluated(r).get("error", 1.0)) for r in HELD]
    print(f"\nheld out: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}")
