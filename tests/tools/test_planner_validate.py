"""The planner against a real run, at a small size: `launch.plan plan.validate=true` calibrates on a
one-process run, runs the best dp layout on 2 gloo ranks (net=none: plain torchrun) and adds what
it measured to the plan. Bytes, saved activations and model state must equal the prediction
exactly; the step time is reported with its error, never asserted (timings on a shared 2-core
machine are noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launcher import CPU_ONLY, PROJECT_ROOT

from parallel.planner.validate import launch_command


def test_validation_adds_measured_columns_that_match_the_closed_forms(tmp_path):
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "launch.plan", "model=tiny", "plan.world=2", "plan.peak_tflops=0.3",
           "plan.layouts=[dp]", "plan.search.zero=[0]", "plan.validate=true", "plan.validate_top=0", "plan.steps=3",
           "plan.warmup_steps=1", f"run.dir={out}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    validated = [r for r in plan["rows"] if "measured" in r]
    assert len(validated) == 1, [r.get("measured_error") for r in plan["rows"]]
    row = validated[0]
    assert row["layout"]["strategy"] == "dp" and row["rank"] == 1
    measured, errors = row["measured"], row["errors"]
    assert errors["bytes_equal"] is True and errors["bytes"] == 0
    assert errors["activations"] == 0 and errors["model_state"] == 0
    assert measured["step_time_s"] > 0 and errors["step_time"] is not None
    assert "torch.distributed.run --standalone --nproc-per-node=2" in measured["command"]
    calibration = plan["meta"]["validation"]["calibration"]
    assert 0 < calibration["efficiency"] <= 1 and plan["meta"]["cluster"]["efficiency"] == calibration["efficiency"]
    assert (out / "calibration-single" / "summary.json").exists()
    assert "Validation: predicted against measured" in (out / "report.md").read_text()


def test_a_layout_runs_on_the_network_it_was_planned_for():
    """net=none is plain torchrun; emulated nodes run through launch.run, with the net settings."""
    assert launch_command(["parallel=dp"], 2, None, None)[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert launch_command(["parallel=single"], 1, None, None)[1:3] == ["-m", "launch.train"]
    net = {"nodes": 2, "procs_per_node": 1, "inter_mbit": 200, "intra_mbit": None, "latency_ms": 0, "loss_pct": 0}
    cmd = launch_command(["parallel=dp"], 2, net, "ethernet_1g")
    assert cmd[1:3] == ["-m", "launch.run"]
    assert "net.inter_mbit=200" in cmd and "net=ethernet_1g" in cmd
    # Settings of an emulated network without a preset name still go to launch.run, never to plain torchrun.
    assert launch_command(["parallel=dp"], 2, net, None)[1:3] == ["-m", "launch.run"]
