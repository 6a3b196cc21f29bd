"""Does the hang verdict name the hung rank, every time? Ten runs at world 4, each with one rank hung.

    python -m bench.hang_verdicts                    # 10 trials, parallel.timeout_s=8
    python -m bench.hang_verdicts trials=4 timeout_s=8

Each trial is a `launch.train` run of the tiny model at world 4 in which one rank hangs
(train.fail_mode=hang) before a step; the trials go through four layouts (tp: dp 2 x tp 2, dp: dp 4,
pp_1f1b: pp 2 x dp 2, 3d: pp 2 x tp 2) and through the ranks, rank 0 included, and the step. A
trial passes when
  - the job ends non-zero within parallel.timeout_s + 10 s of the fault,
  - the verdict (<run dir>/flight/verdict.txt, parallel/reliability/hangs.py) names the hung rank and
    no other as the one the hang starts at, and
  - every call it says the hung rank never posted is borne out by the dumps: the hung rank's count
    on that group (or direction) is below the call's number, and a rank is blocked in that call.
It prints one row per trial and the count of trials passed. Each trial costs a timeout: minutes in
all, which is why this is a benchmark and not a test (tests/runs/test_faults.py has two cases).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import options, train_command
from launch.config import CODE_ROOT
from parallel.dist.flight import channel

# (preset, hung rank, step): the layouts and ranks the trials go through.
TRIALS = [("tp", 1, 2), ("tp", 2, 3), ("dp", 0, 2), ("dp", 3, 1), ("pp_1f1b", 0, 2), ("pp_1f1b", 3, 3),
          ("3d", 0, 1), ("3d", 1, 2), ("3d", 2, 3), ("3d", 3, 2)]
RUN = ["model=tiny", "train.steps=5", "train.warmup_steps=1", "train.global_batch=16", "data.max_bytes=1000000",
       "train.peak_flops=1e11", "run.timeline=false"]
CLAUSE = re.compile(r"(?:rank (?P<one>\d+)|ranks \[(?P<many>[\d, ]+)\]) never posted (?P<op>\w+)(?: (?P<src>\d+)->"
                    r"(?P<dst>\d+))? #(?P<seq>\d+) of group (?P<group>\w+) \(ranks \[(?P<ranks>[\d, ]+)\]\)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def check_verdict(flight: Path, hung: int) -> str | None:
    """None if the verdict holds up against the dumps, else what is wrong."""
    verdict = json.loads((flight / "verdict.json").read_text())
    if verdict["culprits"] != [hung]:
        return f"culprits {verdict['culprits']}, not [{hung}]"
    dumps = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in flight.glob("rank_*.json")}
    clauses = [c for c in CLAUSE.finditer(verdict["verdict"])
               if (int(c["one"]) if c["one"] else None) == hung or (c["many"] and hung in _ints(c["many"]))]
    if not clauses:
        return f"rank {hung} is named in no 'never posted' clause"
    for c in clauses:
        src, dst = (int(c["src"]), int(c["dst"])) if c["src"] else (None, None)
        key, seq = channel(c["group"], _ints(c["ranks"]), src, dst), int(c["seq"])
        if dumps[hung]["counters"].get(key, 0) >= seq:
            return f"rank {hung} did post {key} #{seq}"
        blocked = [d["blocked"] for d in dumps.values() if d["blocked"]]
        if not any(channel(b["group"], b["ranks"], b["src"], b["dst"]) == key and b["seq"] == seq for b in blocked):
            return f"no rank is blocked in {key} #{seq}"
    return None


def trial(preset: str, hung: int, step: int, timeout_s: float, root: Path) -> dict:
    run_dir = root / f"{preset}_rank{hung}"
    cmd = train_command(4, [*RUN, f"parallel={preset}", "train.fail_mode=hang", f"train.fail_at_step={step}",
                            f"train.fail_rank={hung}", f"parallel.timeout_s={timeout_s:g}"], run_dir)
    proc = subprocess.run(cmd, cwd=CODE_ROOT, capture_output=True, text=True, timeout=timeout_s + 300)
    ended = time.time()
    injected = re.search(r"injecting train.fail_mode=hang at step \d+ \(unix time ([\d.]+)\)", proc.stderr)
    after = ended - float(injected.group(1)) if injected else float("nan")
    flight = run_dir / "flight"
    if proc.returncode == 0 or not injected:
        problem = f"exit {proc.returncode}, fault injected: {bool(injected)}"
    elif not (flight / "verdict.json").exists():
        problem = "no verdict"
    else:
        problem = check_verdict(flight, hung)
    if problem is None and not after < timeout_s + 10:
        problem = f"ended {after:.1f} s after the fault"
    verdict = (flight / "verdict.txt").read_text().split("): ", 1)[-1].strip() if (flight / "verdict.txt").exists() \
        else ""
    return {"preset": preset, "hung": hung, "step": step, "after_s": after, "ok": problem is None,
            "problem": problem, "verdict": verdict}


def main(argv: list[str]) -> int:
    opts = options(argv, {"trials": str(len(TRIALS)), "timeout_s": "8"})
    trials, timeout_s = int(opts["trials"]), float(opts["timeout_s"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="hang_verdicts_") as tmp:
        print("| trial | layout | hung rank | step | job ended after the fault | verdict holds | verdict |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for i in range(trials):
            preset, hung, step = TRIALS[i % len(TRIALS)]
            row = trial(preset, hung, step, timeout_s, Path(tmp) / f"trial{i}")
            rows.append(row)
            holds = "yes" if row["ok"] else f"NO: {row['problem']}"
            print(f"| {i} | {preset} | {hung} | {step} | {row['after_s']:.1f} s | {holds} | {row['verdict']} |",
                  flush=True)
    passed = sum(r["ok"] for r in rows)
    print(f"\n{passed} of {trials} trials: the verdict named the hung rank, its group and the call's number "
          f"(parallel.timeout_s={timeout_s:g})")
    return 0 if passed == trials else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
