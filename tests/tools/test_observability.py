"""Where the time goes, the trace, and the noise in the comparison.

The breakdown and trace of real runs are checked in the strategy tests, on the runs they make
anyway (tests/helpers/observability.py: dp, dp_naive, torch_ddp, tp, zero2, the pipelines, 3-D). Here:
the arithmetic of the breakdown and the trace's format on hand-made steps, the warm-up default,
the comparison's rounds, its console table and its override syntax; and one sweep of 2 rounds.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from launcher import GIVEN_LOOPBACK, PROJECT_ROOT
from observability import check_time_breakdown

from launch.config import unquoted_overrides
from parallel.compare.report import CONSOLE, CONSOLE_WIDTH, console_table
from parallel.compare.rounds import aggregate_rounds, round_order
from parallel.compare.rows import COLUMNS, NOISY_SPREAD, failed_row
from parallel.core.phases import PhaseLog
from parallel.dist.groups import LaunchEnv
from parallel.dist.timing import StepClock, default_warmup_steps
from parallel.report.breakdown import WAITING_FOR_SLOWEST, breakdown_notes, rank_step_breakdown, summarize_breakdown
from parallel.report.trace import chrome_trace, draw_timeline, draw_trace_file, from_chrome, rank_label
from parallel.run_plan import build_plan


def phase(name, start, end, label=""):
    return {"phase": name, "label": label, "start": start, "end": end}


def span(op, group, start, end, kind="call", sent=0.0):
    return {"kind": kind, "op": op, "group": group, "tag": f"x/{op}", "payload_bytes": int(sent), "sent_bytes": sent,
            "start": start, "end": end, "blocked": kind != "post"}


def test_breakdown_takes_each_wait_out_of_its_phase():
    phases = [phase("other", 0.0, 1.0), phase("forward", 1.0, 4.0), phase("backward", 4.0, 9.0),
              phase("p2p", 9.0, 10.0), phase("sync", 10.0, 12.0), phase("optimizer", 12.0, 15.0)]
    spans = [span("all_reduce", "tp", 2.0, 3.0),                 # blocking, in forward
             span("all_reduce", "dp", 5.0, 5.0, kind="post"),    # posted in backward: the rank went on
             span("recv", "pp", 9.2, 9.7, kind="wait"),          # waiting for a neighbour: the bubble
             span("all_reduce", "dp", 10.0, 11.5, kind="wait"),  # the dp wait after backward
             span("all_gather", "dp", 13.0, 14.0),               # ZeRO's gather inside the optimizer phase
             span("all_reduce", "dp", 15.0, 16.0)]               # after the step: the loss for the log
    b = rank_step_breakdown(phases, spans, step_s=15.25)
    assert b["compute"] == {"forward": 2.0, "backward": 5.0, "weight": 0.0, "recompute": 0.0}
    assert b["exposed_comm"] == {"all_reduce tp": 1.0, "all_reduce dp": 1.5, "all_gather dp": 1.0}
    assert b["bubble"] == 0.5 and b["optimizer"] == 2.0
    assert b["other"] == {"other": 1.0, "p2p": 0.5, "sync": 0.5}
    assert b["phases_s"] == 15.0 and b["step_s"] == 15.25
    assert rank_step_breakdown([], spans, 1.0) is None


def test_summary_breakdown_is_the_median_step_with_the_wait_for_the_slowest_rank():
    def step(compute, step_s):
        return {"step_s": step_s, "phases_s": step_s,
                "compute": {"forward": compute, "backward": 0.0, "recompute": 0.0},
                "exposed_comm": {"all_reduce dp": 0.5}, "bubble": 0.0, "optimizer": 0.2,
                "other": {"other": step_s - compute - 0.7}}
    # Two ranks, 4 steps, 1 warm-up: the slowest rank's times 3, 5, 4 -> the median is step 3 (4 s).
    rank0 = [step(9, 10), step(2, 3), step(3, 5), step(2.5, 3.5)]
    rank1 = [step(9, 10), step(2, 2.5), step(3, 4.5), step(3, 4)]
    slowest = [10, 3, 5, 4]
    out = summarize_breakdown([rank0, rank1], slowest, timed_from=1, first_step=0, notes=[])
    detail = out["time_breakdown"]
    assert detail["step"] == 3 and detail["step_time_s"] == 4
    r0, r1 = out["time_breakdown_by_rank"]
    assert r0["compute"] == 2.5 and r1["compute"] == 3
    # Rank 0 finished its step in 3.5 s and waited 0.5 s for rank 1: that is in its "other".
    assert r0["other"] == pytest.approx(3.5 - 2.5 - 0.7 + 0.5) and detail["other_s"][WAITING_FOR_SLOWEST] == 0.25
    for r in (r0, r1):
        assert sum(r[c] for c in ("compute", "exposed_comm", "bubble", "optimizer", "other")) == pytest.approx(4)
    assert detail["sum_s"] == pytest.approx(4)
    # A strategy that marks no phases says so.
    unmarked = {"step_s": 1, "phases_s": 1, "compute": {"forward": 0.0}, "exposed_comm": {}, "bubble": 0.0,
                "optimizer": 0.0, "other": {"unmarked": 1.0}}
    assert any("marks no phases" in n for n in breakdown_notes([None], True, [[unmarked]]))
    assert any("comm.time is off" in n for n in breakdown_notes(["a note"], False, [[rank0[1]]]))


def test_phase_log_tiles_the_step_and_ignores_marks_outside_it():
    import torch

    log, clock = PhaseLog(), StepClock(torch.device("cpu"))
    log("forward")  # no clock: outside the training loop, nothing is recorded
    clock.begin_step()
    log.begin_step(clock)
    log("forward", "F0")
    log("backward", "B0")
    log("backward", "B0 again")
    step = clock.end_step()
    log.stop()
    log("optimizer")  # after the step: ignored
    phases = log.resolve()
    assert [p["phase"] for p in phases][-1] == "backward" and "optimizer" not in [p["phase"] for p in phases]
    # From the step's origin to its end, with no gap: they divide exactly the time measured.
    assert phases[0]["start"] == 0.0 and phases[-1]["end"] == step
    assert all(a["end"] == b["start"] for a, b in zip(phases, phases[1:]))
    with pytest.raises(ValueError, match="phase 'think' is none of"):
        log.begin_step(clock)
        log("think")


def test_chrome_trace_has_a_process_per_rank_named_by_its_coordinates():
    dims = {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1}
    assert rank_label(4, {"pp": 1, "dp": 0, "cp": 0, "tp": 0}, dims) == "rank 4 (pp 1, dp 0, tp 0)"
    assert rank_label(1, {"pp": 0, "dp": 1, "cp": 0, "tp": 0}, {"dp": 2, "tp": 1, "pp": 1}) == "rank 1 (dp 1)"
    traces = [{"origin_wall": 100.0 + r, "phases": [phase("forward", 0.0, 0.5, "F0")],
               "spans": [span("all_reduce", "dp", 0.1, 0.2, sent=8.0), span("all_reduce", "dp", 0.3, 0.4, kind="wait")]}
              for r in range(2)]
    events = chrome_trace(traces, ["rank 0 (dp 0)", "rank 1 (dp 1)"])["traceEvents"]
    json.dumps(events)  # plain JSON
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (dp 0)", 1: "rank 1 (dp 1)"}
    x = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in x} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # Rank 1 started its step a second after rank 0: one axis for both, in µs.
    assert [e["ts"] for e in x if e["tid"] == 0] == [0.0, 1e6]
    assert sum(e["args"]["sent_bytes"] for e in x if e["tid"] == 1) == 16.0


def test_the_timeline_drawn_from_trace_json_is_the_runs_own(tmp_path):
    """launch.compare draws its report's timelines from the runs' trace.json files: the traces read
    back give the picture the run would have drawn, pixel for pixel."""
    from matplotlib.image import imread

    traces = [{"origin_wall": 50.0 + 0.002 * r,
               "phases": [phase("forward", 0.0, 0.004, "F0"), phase("backward", 0.004, 0.010, "B0"),
                          phase("optimizer", 0.010, 0.012)],
               "spans": [span("all_reduce", "dp", 0.005, 0.0055, kind="post", sent=8.0),
                         span("all_reduce", "dp", 0.0100, 0.0105, kind="wait"),
                         span("send", "pp", 0.002, 0.003, sent=4.0),
                         span("all_reduce", "world", 0.013, 0.014)]}  # after the step: in the file, not drawn
              for r in range(3)]
    labels = [f"rank {r} (dp {r})" for r in range(3)]
    (tmp_path / "trace.json").write_text(json.dumps(chrome_trace(traces, labels)))
    back, back_labels = from_chrome(json.loads((tmp_path / "trace.json").read_text()))
    assert back_labels == labels
    assert [[s["blocked"] for s in t["spans"]] for t in back] == [[False, True, True, True]] * 3
    assert back[2]["phases"][0]["start"] == pytest.approx(0.004)  # on the earliest rank's axis
    draw_timeline(traces, labels, tmp_path / "run.png", "a title")
    draw_trace_file(tmp_path / "trace.json", tmp_path / "sweep.png", "a title")
    assert (imread(tmp_path / "run.png") == imread(tmp_path / "sweep.png")).all()


def test_warmup_default_leaves_at_least_half_the_steps_timed():
    assert [default_warmup_steps(n) for n in (1, 2, 3, 4, 5, 6, 7, 20)] == [0, 1, 1, 2, 2, 3, 3, 3]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", "parallel=single", "train.steps=3"])
    plan = build_plan(cfg, LaunchEnv(rank=0, world_size=1, local_world_size=1), cuda_available=False)
    assert (plan.warmup_steps, plan.warmup_default) == (1, True)


def row(strategy, tokens, round_=0, ratio=None, status="ok", spread=(90.0, 110.0), runs_as=None):
    r = dict.fromkeys(COLUMNS)
    r.update(strategy=strategy, runs_as=runs_as or strategy, status=status, layout="2x1x1 m1", world=2,
             tokens_per_s=tokens, tokens_per_step=512, step_ms=512e3 / tokens, step_ms_min=spread[0],
             step_ms_max=spread[1], spread=0.2,
             noisy=False, ratio_to_baseline=ratio, round=round_, rounds_ok=1, error="")
    return r


def test_rounds_rotate_and_report_the_median_with_its_interval():
    orders = [round_order(["a", "b", "c"], k) for k in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    rounds = [[row("dp", 1000, 0, ratio=0.9), row("ddp", 1100, 0)],
              [row("dp", 1200, 1, ratio=1.1, spread=(80.0, 200.0)), row("ddp", 1090, 1)],
              [row("dp", 1100, 2, ratio=1.0), failed_row("ddp", 2, "timeout", "stopped", 300.0)]]
    dp, ddp = aggregate_rounds(rounds, ["dp", "ddp"])
    # The median round's run, the interval over all rounds, the ratios paired within each round.
    assert (dp["round"], dp["tokens_per_s"], dp["tokens_per_s_lo"], dp["tokens_per_s_hi"]) == (2, 1100, 1000, 1200)
    assert (dp["ratio_to_baseline"], dp["ratio_lo"], dp["ratio_hi"]) == (1.0, 0.9, 1.1)
    assert (dp["step_ms_min"], dp["step_ms_max"], dp["rounds_ok"]) == (80.0, 200.0, 3)
    assert dp["spread"] == pytest.approx(120 / (512e3 / 1100)) and dp["noisy"] is (dp["spread"] > NOISY_SPREAD)
    assert ddp["rounds_ok"] == 2 and ddp["tokens_per_s_lo"] == 1090 and "timeout in 1 of 3 rounds" in ddp["error"]
    one = aggregate_rounds([[row("dp", 1000)]], ["dp"])[0]
    assert one["tokens_per_s"] == 1000 and one["tokens_per_s_lo"] is None


def test_rounds_keep_each_pair_side_by_side_and_alternate_which_runs_first():
    sweep = ["single", "dp", "torch_ddp", "pp_zbh1", "torch_pp_interleaved_zb", "tp"]
    partners = {"dp": "torch_ddp", "pp_zbh1": "torch_pp_interleaved_zb", "tp": "torch_tp"}  # torch_tp not swept
    orders = [round_order(sweep, k, partners) for k in range(5)]
    assert orders[0] == sweep
    assert orders[1] == ["torch_ddp", "dp", "torch_pp_interleaved_zb", "pp_zbh1", "tp", "single"]
    assert orders[2] == ["pp_zbh1", "torch_pp_interleaved_zb", "tp", "single", "dp", "torch_ddp"]
    for k, order in enumerate(orders):
        assert sorted(order) == sorted(sweep)
        for ours, theirs in [("dp", "torch_ddp"), ("pp_zbh1", "torch_pp_interleaved_zb")]:
            # Neighbours in every round, ours first in even rounds and PyTorch's first in odd ones.
            assert order.index(theirs) - order.index(ours) == (1 if k % 2 == 0 else -1), (k, order)
    # PyTorch's listed first: the pair still runs side by side, ours first in even rounds.
    assert round_order(["torch_ddp", "single", "dp"], 0, {"dp": "torch_ddp"}) == ["dp", "torch_ddp", "single"]
    assert round_order(["torch_ddp", "single", "dp"], 1, {"dp": "torch_ddp"}) == ["single", "torch_ddp", "dp"]
    # Two of ours naming one counterpart: the first listed (dp_naive) takes it, dp runs alone.
    two = {"dp": "torch_ddp", "dp_naive": "torch_ddp"}
    assert round_order(["dp_naive", "dp", "torch_ddp"], 0, two) == ["dp_naive", "torch_ddp", "dp"]
    assert round_order(["dp_naive", "dp", "torch_ddp"], 1, two) == ["dp", "torch_ddp", "dp_naive"]


def test_the_sweep_finds_each_presets_counterpart_by_strategy_and_schedule():
    from hydra import initialize_config_dir

    from launch.compare import swept_counterparts
    from launch.config import CONFIG_DIR

    sweep = ["single", "dp", "torch_ddp", "zero1", "torch_zero1", "zero2", "torch_zero2", "zero3", "torch_fsdp2",
             "tp", "torch_tp", "pp_gpipe", "torch_pp_gpipe", "pp_zbh1", "torch_pp_interleaved_zb", "pp_dualpipev",
             "torch_pp_dualpipev", "pp_zbv", "nonexistent_preset"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        partners = swept_counterparts(sweep)
    assert partners == {"dp": "torch_ddp", "zero1": "torch_zero1", "zero2": "torch_zero2", "zero3": "torch_fsdp2",
                        "tp": "torch_tp", "pp_gpipe": "torch_pp_gpipe", "pp_zbh1": "torch_pp_interleaved_zb",
                        "pp_dualpipev": "torch_pp_dualpipev"}  # pp_zbv's counterpart is not in this sweep


def test_console_table_fits_120_columns():
    typical = [row("torch_pp_interleaved", 2186.0, ratio=0.82), row("dp", 123456.0)]
    for r in typical:
        r.update(layout="1x1x4 m4 v2", mfu=0.021, bytes_per_step=1.879e6, matches_theory=True, exposed_comm_share=0.33,
                 bubble_share=0.4, peak_memory_mb_max=352.0, same_losses_as_single=True, tokens_per_s_lo=1548.0,
                 tokens_per_s_hi=2824.0, ratio_lo=0.69, ratio_hi=0.95)
    table = console_table(typical + [failed_row("tp", 3, "failed", "exit 2: " + "x" * 300, 1.0)])
    assert max(len(line) for line in table.splitlines()) <= CONSOLE_WIDTH, table
    assert all(h in table.splitlines()[0] for h, _, _ in CONSOLE) and "left out" not in table
    # Extreme figures: the least needed columns go, and the table says which.
    extreme = [dict(typical[0], layout="2x2x2 m16 v2 sp", tokens_per_s=1234567.0, tokens_per_s_lo=12345.0,
                    tokens_per_s_hi=9999999.0, step_ms=123456.7, bytes_per_step=1.2e12, peak_memory_mb_max=1.2e6)]
    table = console_table(extreme)
    assert max(len(line) for line in table.splitlines()) <= CONSOLE_WIDTH and "left out to fit 120 columns" in table


def test_unquoted_compare_overrides_are_refused_with_the_quoted_form():
    error = unquoted_overrides(["compare.world=2", "compare.overrides=[parallel.microbatches=8,train.lr=0.01]"])
    assert error and """'compare.overrides=["parallel.microbatches=8","train.lr=0.01"]'""" in error
    assert unquoted_overrides(['compare.overrides=["parallel.microbatches=8"]']) is None
    assert unquoted_overrides(["compare.overrides=['parallel.pp_layers=[1,3]']"]) is None
    assert unquoted_overrides(["compare.overrides=[]", "train.steps=3"]) is None


def test_compare_rounds_rotate_the_order_and_report_intervals(tmp_path):
    """Two rounds of dp and its PyTorch counterpart, one extra override given in the documented form."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch.compare", "compare.world=2", "compare.strategies=[dp,torch_ddp]",
           "compare.rounds=2", 'compare.overrides=["parallel.microbatches=2"]', "compare.peak_flops=1e11",
           "compare.timeout_s=200", "model=tiny", "train.steps=3", "data.max_bytes=1000000", *GIVEN_LOOPBACK,
           f"run.dir={out}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Round 1 runs the strategies in the other order, each run its own launch and directory.
    started = [line.split("running ")[1].split(" ")[0] for line in proc.stdout.splitlines() if "running " in line]
    assert started == ["dp", "torch_ddp", "torch_ddp", "dp"]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["orders"] == [["dp", "torch_ddp"], ["torch_ddp", "dp"]]
    for k in (0, 1):
        for name in ("dp", "torch_ddp"):
            s = json.loads((out / f"round{k}" / name / "summary.json").read_text())
            # train.steps=3 alone: the default warm-up (1) leaves 2 timed steps; the override reached the run.
            assert (s["warmup_steps"], s["parallel"]["microbatches"]) == (1, 2)
            check_time_breakdown(s)
    with open(out / "results.csv") as f:
        rows = {r["strategy"]: r for r in csv.DictReader(f)}
    dp, ddp = rows["dp"], rows["torch_ddp"]
    assert float(dp["tokens_per_s_lo"]) <= float(dp["tokens_per_s"]) <= float(dp["tokens_per_s_hi"])
    assert float(dp["ratio_lo"]) <= float(dp["ratio_to_baseline"]) <= float(dp["ratio_hi"])
    assert dp["baseline"] == "torch_ddp" and dp["noisy"] in ("True", "False")
    assert float(dp["step_ms_min"]) <= float(dp["step_ms"]) <= float(dp["step_ms_max"])
    assert dp["rounds_ok"] == ddp["rounds_ok"] == "2" and float(dp["compute_ms"]) > 0
    with open(out / "rounds.csv") as f:
        assert sorted((r["round"], r["strategy"]) for r in csv.DictReader(f)) == [
            ("0", "dp"), ("0", "torch_ddp"), ("1", "dp"), ("1", "torch_ddp")]
    report = (out / "report.md").read_text()
    assert report.splitlines()[2].startswith("The fastest layout is **")
    for name in ("time_breakdown.png", "tokens_per_s.png", "memory_per_rank.png", "timeline_dp.png"):
        assert (out / name).stat().st_size > 0, name
    table = proc.stdout[proc.stdout.index("strategy "):proc.stdout.index("strategies ran")]
    assert max(len(line) for line in table.splitlines()) <= CONSOLE_WIDTH
