"""The planner's command line (launch/plan.py): the ranked plan it writes, a model without cp formulas,
bad input refused in one line, and one layout given as launch.train's overrides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from launcher import CPU_ONLY, PROJECT_ROOT

from parallel.planner.cluster import ClusterError, cluster_from_config


def _plan(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **CPU_ONLY})


def test_launch_plan_writes_the_ranked_plan(tmp_path):
    out = tmp_path / "plan"
    proc = _plan(["model=tiny", "plan.world=4", "plan.peak_tflops=0.3", "plan.layouts=[dp,tp,pp_1f1b,zero3,3d]",
                  "cluster.loopback_gbytes_per_s=1.0", "cluster.loopback_latency_us=100",
                  "cluster.codec_gbytes_per_s=1.0", f"run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny on 4 x this_machine" in proc.stdout and "MFU %" in proc.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert {"model", "cluster", "world", "assumptions"} <= set(plan["meta"])
    row = plan["rows"][0]
    assert {"preset", "dp", "tp", "pp", "zero", "sequence_parallel", "microbatches", "schedule",
            "virtual_stages"} <= set(row["layout"])
    assert set(row["memory_bytes_per_device"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert set(row["bytes_per_step"]) == {"intra_node", "inter_node"}
    assert set(row["step_time_s"]) == {"compute", "exposed_comm", "bubble", "total", "codec", "optimizer", "copies"}
    assert 0 < row["mfu"] < 1 and row["fits"] is True
    kept = {"dp", "tp", "pp_1f1b", "zero3", "3d"}
    assert all(r["layout"]["preset"] in kept or r["layout"]["strategy"] in kept for r in plan["rows"])
    assert [r["rank"] for r in plan["rows"]] == list(range(1, len(plan["rows"]) + 1))
    totals = [r["step_time_s"]["total"] for r in plan["rows"] if r["fits"]]
    assert totals == sorted(totals)
    for name in ("report.md", "memory_per_device.png", "step_time.png"):
        assert (out / name).stat().st_size > 0


def test_a_model_without_cp_formulas_is_not_searched_with_them(tmp_path):
    """Saved bytes under cp have formulas for the sandbox GPT in fp32 only: for a planner shape (here in bf16
    on H100s) no row with cp may appear, where they would all be "?"; recomputation is searched, every row's
    memory known (parallel/planner/memory.py's implementation accounting)."""
    out = tmp_path / "plan"
    proc = _plan(["model=gpt2_124m", "cluster=h100_sxm", "plan.world=8", "plan.global_batch=64",
                  "plan.layouts=[dp,3d]", f"run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["meta"]["search"]["context_parallel"] is False
    assert plan["rows"] and all(r["layout"]["cp"] == 1 for r in plan["rows"])
    assert {r["layout"].get("recompute") for r in plan["rows"]} == {"none", "selective", "full"}
    assert all(r["fits"] is not None and r["hfu"] >= r["mfu"] * 0.99 for r in plan["rows"])


def test_a_bf16_search_asked_for_cp_judges_the_rings_memory(tmp_path):
    """Asked for (plan.search.context_parallel=true), a bf16 search has cp rows: the ring's saved bytes have a
    bf16 figure (each rank's s/cp tokens), so its rows say whether they fit; the all-to-all's have none ("?")."""
    out = tmp_path / "plan"
    proc = _plan(["model=gpt2_124m", "cluster=h100_sxm", "plan.world=8", "plan.global_batch=64",
                  "plan.layouts=[cp,cp_a2a]", "plan.search.context_parallel=true", "plan.top=100", f"run.dir={out}"],
                 tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "plan.json").read_text())["rows"]
    ring = [r for r in rows if r["layout"]["cp"] > 1 and r["layout"]["cp_kind"] == "ring"]
    a2a = [r for r in rows if r["layout"]["cp"] > 1 and r["layout"]["cp_kind"] == "a2a"]
    assert ring and all(r["fits"] is not None for r in ring)
    assert a2a and all(r["fits"] is None for r in a2a)


def test_launch_plan_refuses_bad_input_in_one_line(tmp_path):
    proc = _plan(["plan.world=0"], tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == ["error: plan.world=0 must be a positive integer"], proc.stderr[-2000:]
    with pytest.raises(ClusterError, match="efficiency=2.0 .* must be fractions in"):
        cluster_from_config({**yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "h100_sxm.yaml").read_text()),
                             "efficiency": 2})


def test_launch_plan_evaluates_one_layout_given_as_launch_trains_overrides(tmp_path):
    out = tmp_path / "one"
    proc = _plan(["model=gpt2_124m", "cluster=h100_sxm", "plan.world=16", "plan.global_batch=64", "parallel=3d",
                  "parallel.tp=2", "parallel.pp=2", "plan.microbatch_size=2", "parallel.schedule=interleaved_1f1b",
                  "parallel.virtual_stages=2", "parallel.grad_sync=naive", f"run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one layout" in proc.stdout and "MFU (model FLOPs / peak)" in proc.stdout
    rows = json.loads((out / "plan.json").read_text())["rows"]
    assert len(rows) == 1
    layout = rows[0]["layout"]
    assert (layout["dp"], layout["tp"], layout["pp"], layout["microbatch_size"], layout["microbatches"]) == \
        (4, 2, 2, 2, 8)
    assert layout["schedule"] == "interleaved_1f1b" and layout["virtual_stages"] == 2


def test_a_row_names_its_schedule_only_where_a_pipeline_runs():
    from parallel.planner.report import layout_label

    row = {"dp": 8, "tp": 1, "pp": 1, "microbatches": 4, "microbatch_size": 1, "schedule": "1f1b",
           "virtual_stages": 1, "pp_layers": None, "zero": 1, "sequence_parallel": False}
    assert "1f1b" not in layout_label(row).split()
    assert "interleaved_1f1b v2" in layout_label({**row, "dp": 4, "pp": 2, "schedule": "interleaved_1f1b",
                                                  "virtual_stages": 2})
