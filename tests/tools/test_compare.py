"""launch.compare as a user runs it: a small sweep on the tiny model, with one PyTorch baseline
and two strategies that cannot run (a layout that does not divide, a name with no preset); the
default sweep on the tiny Llama-shaped model, every row equal to single and to theory; a sweep
ranked in virtual time, whose runs compute on one thread per rank."""

import csv
import json
import os
import subprocess
import sys

from launcher import GIVEN_LOOPBACK, PROJECT_ROOT

from parallel.compare.rows import COLUMNS


def test_compare_sweep_reports_every_strategy(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch.compare", "compare.world=2",
           "compare.strategies=[single,dp,torch_ddp,tp,no_such]", "+compare.worlds.tp=3", "compare.timeout_s=200",
           "model=tiny", "train.steps=4", "train.warmup_steps=1", "data.max_bytes=1000000", f"run.dir={out}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=500, env=os.environ.copy())
    # Two strategies did not run: everything is written, and the exit status says the sweep is not whole.
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: 2 of 5 strategies did not run: tp, no_such"
    for name in ("results.csv", "results.json", "report.md", "tokens_per_s.png", "bytes_per_step.png",
                 "memory_per_rank.png"):
        assert (out / name).stat().st_size > 0, name
    for strategy in ("single", "dp", "torch_ddp"):
        assert (out / strategy / "summary.json").exists()
    # The loopback probed once before the runs (the suite's other sweeps are given it) and handed to each run.
    assert "compare: loopback for virtual time" in proc.stdout and "(probed once, given to every run)" in proc.stdout
    for strategy in ("dp", "torch_ddp"):
        link = json.loads((out / strategy / "summary.json").read_text())["virtual"]["link_model"]
        assert link["source"].startswith("given (virtual.loopback_gbytes_per_s"), link

    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        assert [r["strategy"] for r in reader] == ["single", "dp", "torch_ddp", "tp", "no_such"]
    rows = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["rows"]}

    # The failures are rows with their error, and did not stop the sweep.
    assert rows["tp"]["status"] == "failed", rows["tp"]
    assert "world size 3 is not divisible by parallel.tp" in rows["tp"]["error"], rows["tp"]
    assert rows["no_such"]["status"] == "failed" and "conf/parallel/no_such.yaml" in rows["no_such"]["error"]
    assert rows["tp"]["tokens_per_s"] is None

    # Every strategy that ran trained the single-process model, moved theory's bytes, and has its figures.
    for name in ("single", "dp", "torch_ddp"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["same_losses_as_single"] is True and row["max_rel_loss_diff"] < 1e-5, row
        assert row["matches_theory"] is True, row
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["mfu"] > 0
        assert len(row["peak_memory_mb_by_rank"]) == row["world"]
    assert rows["dp"]["layout"] == "2x1x1 m1" and rows["dp"]["baseline"] == "torch_ddp"
    assert rows["dp"]["ratio_to_baseline"] == rows["dp"]["tokens_per_s"] / rows["torch_ddp"]["tokens_per_s"]
    assert rows["torch_ddp"]["exposed_comm_share"] is None  # DDP waits where the log cannot see
    assert rows["dp"]["exposed_comm_share"] is not None

    report = (out / "report.md").read_text()
    assert "| strategy |" in report and "no_such" in report and "tokens_per_s.png" in report
    assert "5/5" in proc.stdout and "3/5 strategies ran" in proc.stdout


def test_every_strategy_trains_llamas_block_as_single_with_theorys_bytes(tmp_path):
    """`launch.compare model=tiny_llama`, the default sweep (every strategy and PyTorch's own that
    runs at world 2; 3d at 4): each row ran, trained the single-process model (=single) and moved
    its closed form's bytes (=theory) on Llama's block (GQA, SwiGLU, RMSNorm, RoPE, no biases)."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch.compare", "model=tiny_llama", "compare.world=2",
           "compare.worlds={single:1,3d:4}", "compare.peak_flops=1e11", "train.steps=4", "train.warmup_steps=1",
           "data.max_bytes=1000000", *GIVEN_LOOPBACK, f"run.dir={out}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 21, [r["strategy"] for r in rows]
    wrong = {r["strategy"]: r.get("error") or {k: r[k] for k in ("same_losses_as_single", "matches_theory")}
             for r in rows
             if r["status"] != "ok" or r["same_losses_as_single"] is not True or r["matches_theory"] is not True}
    assert not wrong, wrong
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_compare_with_nothing_to_run_fails(tmp_path):
    """A sweep in which no strategy ran (a misspelt name) writes what it has and exits non-zero,
    without probing the loopback for runs that never start."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch.compare", "compare.strategies=[dpp]", "compare.peak_flops=1e11", "model=tiny",
           f"run.dir={out}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error: 1 of 1 strategies did not run: dpp" in proc.stderr
    assert (out / "results.csv").exists() and "0/1 strategies ran" in proc.stdout
    assert "loopback for virtual time" not in proc.stdout  # nothing to run: no probe was started


def test_a_virtual_sweep_runs_single_on_one_core_and_its_speed_up_is_per_core(tmp_path):
    """In virtual time every run computes on one thread per rank (a rank's device is a core per
    thread, parallel/replay/device.py): single is one core like each dp rank, so dp's speed-up over
    it is per core, and one above its ranks would be flagged as not the clock's."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch.compare", "compare.world=2", "compare.strategies=[single,dp]",
           "compare.clock=virtual", "compare.peak_flops=1e11", "model=tiny", "train.steps=3", "train.warmup_steps=1",
           "data.max_bytes=1000000", *GIVEN_LOOPBACK, f"run.dir={out}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for strategy in ("single", "dp"):
        events = json.loads((out / strategy / "events" / "rank0.json").read_text())
        assert events["threads"] == 1, strategy
        virtual = json.loads((out / strategy / "summary.json").read_text())["virtual"]
        assert virtual["device_per_rank"]["cores"] == 1 and virtual["device_per_rank"]["compute_clock"] == "thread_cpu"
    rows = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    single, dp = rows["single"], rows["dp"]
    assert single["speedup_vs_single"] == 1.0 and dp["clock"] == "virtual" and dp["virtual_cores_per_rank"] == 1
    assert dp["speedup_vs_single"] == dp["tokens_per_s"] / single["tokens_per_s"] == \
        dp["virtual_tokens_per_s"] / single["virtual_tokens_per_s"]
    assert (dp["speedup_note"] == "") == (dp["speedup_vs_single"] <= 2), dp["speedup_note"]
    report = (out / "report.md").read_text()
    assert "every run computes on one thread per rank" in report and "| x single |" in report
