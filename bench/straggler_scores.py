"""Does the straggler score stay quiet on clean runs and find a slowed rank, at world 4?

    python -m bench.straggler_scores                  # 100 clean steps of dp and of tp, then a slowed run of each
    python -m bench.straggler_scores steps=100 slow_steps=30 factor=2.0

Each run is a `launch.train` run of the tiny model at world 4 (4 ranks on however many cores the
machine has: on 2 cores they take turns, which the score's clock, each rank's thread CPU time, does
not see). The clean runs report every rank's highest score over all steps and the steps on which
any rank was flagged (there should be none); the slowed runs (train.fail_mode=slow on rank 2 from
step 10, train.slow_factor) the first step rank 2 is flagged and its score once the window holds
slowed steps only, against the factor. tests/runs/test_stragglers.py is the short case at world 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import options, train_command
from launch.config import CODE_ROOT

RUN = ["model=tiny", "train.warmup_steps=1", "train.global_batch=8", "data.max_bytes=1000000",
       "train.peak_flops=1e11", "run.timeline=false", "virtual.loopback_gbytes_per_s=1.62",
       "virtual.loopback_latency_us=180", "virtual.loopback_p2p_latency_us=127"]
SLOW_RANK, SLOW_AT = 2, 10


def scores_of(preset: str, steps: int, extra: list[str], root: Path) -> list[dict]:
    run_dir = root / f"{preset}_{len(extra)}"
    cmd = train_command(4, [*RUN, f"parallel={preset}", f"train.steps={steps}", *extra], run_dir)
    proc = subprocess.run(cmd, cwd=CODE_ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{preset} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str]) -> int:
    opts = options(argv, {"steps": "100", "slow_steps": "30", "factor": "2.0", "presets": "dp,tp"})
    steps, slow_steps, factor = int(opts["steps"]), int(opts["slow_steps"]), float(opts["factor"])
    ok = True
    with tempfile.TemporaryDirectory(prefix="straggler_scores_") as tmp:
        print("| layout | run | steps | highest score per rank | steps with a rank flagged | "
              f"rank {SLOW_RANK} first flagged | rank {SLOW_RANK}'s last score |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for preset in opts["presets"].split(","):
            clean = scores_of(preset, steps, [], Path(tmp))
            highest = [max(m["straggler_scores"][r] for m in clean) for r in range(4)]
            flagged = [m["step"] for m in clean if m["stragglers"]]
            ok &= not flagged
            print(f"| {preset} | clean | {steps} | {[round(h, 3) for h in highest]} | {flagged or 'none'} | - | - |",
                  flush=True)
            slowed = scores_of(preset, slow_steps, ["train.fail_mode=slow", f"train.fail_at_step={SLOW_AT}",
                                                    f"train.fail_rank={SLOW_RANK}", f"train.slow_factor={factor}"],
                               Path(tmp))
            first = next((m["step"] for m in slowed if SLOW_RANK in m["stragglers"]), None)
            last = slowed[-1]["straggler_scores"][SLOW_RANK]
            others = sorted({r for m in slowed for r in m["stragglers"]} - {SLOW_RANK})
            ok &= first is not None and first < SLOW_AT + 10 and abs(last - factor) <= 0.1 * factor and not others
            print(f"| {preset} | rank {SLOW_RANK} x{factor:g} from step {SLOW_AT} | {slow_steps} | "
                  f"{[round(max(m['straggler_scores'][r] for m in slowed), 3) for r in range(4)]} | "
                  f"{sum(1 for m in slowed if m['stragglers'])} (other ranks flagged: {others or 'none'}) | "
                  f"{first} | {last:.3f} |", flush=True)
    print(f"\n{'every check held' if ok else 'a check FAILED'}: no flag on clean steps; the slowed rank flagged "
          f"within 10 steps with a score within 10% of {factor:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
