"""Goodput under chaos, measured at three checkpoint intervals against the Young/Daly model.

    python -m bench.chaos_goodput                       # 3 chaos jobs of 10 minutes each, world 2, model=tiny
    python -m bench.chaos_goodput minutes=2 failures=4  # shorter jobs (say so wherever you quote them)

First a calibration job, apart from the chaos jobs: a short run with checkpoints and one forced
failure (`train.fail_mode=kill`, rank 1 SIGKILLed half-way, torchrun restarting it once). Its job
log gives the model's inputs: t (the median useful step), delta (the median blocking save) and R
(from the fault to the new attempt's first step, beyond a normal step). The mean time between
failures M is chosen so that a job of `minutes` expects `failures` of them; the model's optimum
tau* = sqrt(2 delta M) - delta then sets the three intervals, tau*/3, tau* and 3 tau* (in whole
steps). Each chaos job runs the same number of steps, sized to last about `minutes`, under
`torchrun --max-restarts` with `train.resume=auto` and the same chaos seed, so the three see the
same draw in each attempt. Nothing measured in the chaos jobs feeds the prediction: the table
sets each job's measured goodput (useful steps' time over wall time, summary.json's `goodput`)
beside the model's from the calibration, first order and Daly's, and says where the measured
and the predicted best interval fall. A second prediction uses the failures each job actually
had (M = its wall time / its failures), to separate the model's error from the draw's luck.

Options (key=value, or --key=value): minutes (10), failures (6: expected per job), seed (1),
world (2), global_batch (256: a step long enough that a 10-minute job is about a thousand steps),
multipliers (0.333,1,3), out (runs/chaos_goodput), max_restarts (1000). Other arguments are
training overrides. Checkpoints are deleted after each job (hundreds of saves).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench import harness
from parallel.reliability.goodput import GoodputInputs, daly_interval, predict, with_startup
from parallel.reliability.goodput_report import restart_cost

DEFAULTS = {"minutes": "10", "failures": "6", "seed": "1", "world": "2", "global_batch": "256",
            "multipliers": "0.333,1,3", "out": "runs/chaos_goodput", "max_restarts": "1000"}
CALIBRATION_STEPS, CALIBRATION_EVERY = 40, 5


def command(world: int, max_restarts: int, overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            f"--max-restarts={max_restarts}", "-m", "launch.train", *overrides, f"run.dir={run_dir}"]


def _job(cmd: list[str], run_dir: Path, timeout_s: float) -> dict:
    """One job, its summary, the machine's load before and after; its checkpoints removed."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    load_before = os.getloadavg()[0]
    print(f"$ {harness.shown(cmd)}", flush=True)
    summary = harness.run(cmd, run_dir, timeout_s)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    summary["bench_load"] = (load_before, os.getloadavg()[0])
    return summary


def calibrate(base: list[str], world: int, out: Path) -> tuple[GoodputInputs, float, dict]:
    """t, delta and R (M and n are left to the caller), and the one-time start-up S0, from one short
    job with one forced failure."""
    overrides = [*base, f"train.steps={CALIBRATION_STEPS}", f"train.checkpoint_every={CALIBRATION_EVERY}",
                 "train.resume=auto", "train.fail_mode=kill", f"train.fail_at_step={CALIBRATION_STEPS // 2 + 2}",
                 "train.fail_rank=1"]
    summary = _job(command(world, 1, overrides, out / "calibration"), out / "calibration", 900)
    g = summary["goodput"]
    step_s = sorted(g["step_spans_s"])[len(g["step_spans_s"]) // 2]
    save_s = sorted(g["save_spans_s"])[len(g["save_spans_s"]) // 2]
    restart = restart_cost(g["failures"], step_s)
    if restart is None:
        raise SystemExit(f"the calibration job had no failure to measure R from: {out / 'calibration'}")
    return GoodputInputs(step_s, 1, save_s, restart, 1.0), g["first_setup_s"], summary


def job_prediction(inputs: GoodputInputs, startup_s: float, steps: int) -> dict:
    """Both models' goodput at `inputs`, over a job of `steps` useful steps that pays S0 once."""
    got = predict(inputs)
    useful = steps * inputs.step_s
    return {**got, "first_order_job": with_startup(got["first_order"], startup_s, useful),
            "daly_job": with_startup(got["daly"], startup_s, useful), "startup_s": startup_s}


def _row(mult: float, every: int, inputs: GoodputInputs, startup_s: float, steps: int, summary: dict) -> dict:
    g = summary["goodput"]
    at = GoodputInputs(inputs.step_s, every, inputs.save_s, inputs.restart_s, inputs.mtbf_s)
    failures = len(g["failures"])
    seen = (GoodputInputs(inputs.step_s, every, inputs.save_s, inputs.restart_s, g["wall_s"] / failures)
            if failures else None)
    return {"multiplier": mult, "every": every, "interval_s": at.interval_s, "failures": failures,
            "attempts": g["attempts"], "wall_s": g["wall_s"], "measured": g["measured"],
            "predicted": job_prediction(at, startup_s, steps),
            "predicted_seen": job_prediction(seen, startup_s, steps) if seen else None,
            "parts_s": g["parts_s"], "recomputed_steps": g["recomputed_steps"], "load": summary["bench_load"]}


def table(rows: list[dict]) -> str:
    head = ("| interval | steps per checkpoint | failures (attempts) | wall | measured goodput | model, first order "
            "| model, Daly | measured - Daly | Daly with the failures seen | load before/after |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        p, s = r["predicted"], r["predicted_seen"]
        seen = f"{s['daly_job']:.3f}" if s else "-"
        lines.append(
            f"| {r['multiplier']:g} tau* = {r['interval_s']:.1f} s | {r['every']} | {r['failures']} ({r['attempts']}) "
            f"| {r['wall_s']:.0f} s | {r['measured']:.3f} | {p['first_order_job']:.3f} | {p['daly_job']:.3f} "
            f"| {100 * (r['measured'] - p['daly_job']):+.1f} points | {seen} "
            f"| {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    overrides, o = harness.split_args([a.lstrip("-") for a in argv], DEFAULTS)
    minutes, world, seed = float(o["minutes"]), int(o["world"]), int(o["seed"])
    out = Path(o["out"])
    base = ["model=tiny", "parallel=dp", f"train.global_batch={o['global_batch']}", "train.warmup_steps=0",
            *overrides]
    started = time.time()
    inputs, startup, calibration = calibrate(base, world, out)
    mtbf = minutes * 60 / float(o["failures"])
    inputs = GoodputInputs(inputs.step_s, 1, inputs.save_s, inputs.restart_s, mtbf)
    best = daly_interval(inputs.save_s, mtbf)
    expected = predict(GoodputInputs(inputs.step_s, max(1, round(best / inputs.step_s)), inputs.save_s,
                                     inputs.restart_s, mtbf))["daly"]
    steps = max(10, round((minutes * 60 - startup) * expected / inputs.step_s))  # a job of about `minutes`
    print(f"calibration ({out / 'calibration'}: {CALIBRATION_STEPS} steps, a checkpoint every {CALIBRATION_EVERY}, "
          f"rank 1 SIGKILLed once): t = {inputs.step_s:.3f} s, delta = {inputs.save_s:.3f} s, "
          f"R = {inputs.restart_s:.2f} s, S0 = {startup:.2f} s; M = {mtbf:.0f} s "
          f"({o['failures']} failures expected in {minutes:g} min); "
          f"tau* = {best:.2f} s; {steps} steps per job; {world} ranks on {os.cpu_count()} cores", flush=True)
    rows = []
    for mult in [float(m) for m in o["multipliers"].split(",")]:
        every = max(1, round(mult * best / inputs.step_s))
        run_dir = out / f"every{every}"
        job = [*base, f"train.steps={steps}", f"train.checkpoint_every={every}", "train.resume=auto",
               f"train.chaos.mtbf_s={mtbf:g}", f"train.chaos.seed={seed}"]
        summary = _job(command(world, int(o["max_restarts"]), job, run_dir), run_dir, minutes * 60 * 3 + 600)
        rows.append(_row(mult, every, inputs, startup, steps, summary))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    report = {"calibration": {"inputs": inputs.as_dict(), "startup_s": startup, "run_dir": str(out / "calibration"),
                              "goodput": calibration["goodput"]["measured"]},
              "steps": steps, "seed": seed, "world": world, "cores": os.cpu_count(), "minutes": minutes,
              "rows": rows, "bench_wall_s": time.time() - started}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(table(rows))
    measured_best = max(rows, key=lambda r: r["measured"])
    model_best = max(rows, key=lambda r: r["predicted"]["daly_job"])
    print(f"best interval: measured {measured_best['every']} steps, model {model_best['every']} steps "
          f"(tau* = {best:.2f} s = {best / inputs.step_s:.1f} steps); bench wall {time.time() - started:.0f} s; "
          f"report {out / 'report.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
