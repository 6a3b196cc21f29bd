"""What does each low-precision format cost the loss? dp at world 2 on `small`, once per parallel.comm_dtype.

    python -m bench.lowprec_loss                                  # 300 steps of model=small, dp world 2
    python -m bench.lowprec_loss steps=20 model=tiny              # a quick look that it runs
    python -m bench.lowprec_loss seed=7                           # another init and data order (train.seed)

Every run is a `launch.train` run of the same config, seed and data (parallel=dp at world 2), that
differs only in parallel.comm_dtype: fp32, bf16, int8 and fp8 (parallel/sync/lowprec.py). The
report is one markdown row per format: the bytes each rank sends per step (measured, and whether
they equal the closed form), the mean loss of the last 10% of the steps, and its gap against fp32's,
absolute and relative, with the largest gap of any single step. `strategies=dp,zero2,zero3` runs
the formats under the ZeRO stages too (ZeRO-3 then gathers its weights in the format as well).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.harness import RunFailed, options, run, shown, train_command

FORMATS = ("fp32", "bf16", "int8", "fp8")
RUN = ["train.peak_flops=1e11", "run.timeline=false", "virtual.loopback_gbytes_per_s=1.62",
       "virtual.loopback_latency_us=180", "virtual.loopback_p2p_latency_us=127"]


def tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def one_run(strategy: str, fmt: str, opts: dict, root: Path) -> dict:
    overrides = [f"model={opts['model']}", f"parallel={strategy}", f"parallel.comm_dtype={fmt}",
                 f"train.steps={opts['steps']}", f"train.seed={opts['seed']}", *RUN]
    cmd = train_command(int(opts["world"]), overrides, root / f"{strategy}_{fmt}")
    print(f"# {shown(cmd)}", file=sys.stderr, flush=True)
    return run(cmd, root / f"{strategy}_{fmt}")


def row(strategy: str, fmt: str, summary: dict, reference: dict) -> str:
    losses, ref = summary["losses"], reference["losses"]
    gap = tail_mean(losses) - tail_mean(ref)
    worst = max(abs(a - b) for a, b in zip(losses, ref))
    sent = summary["comm"]["sent_bytes_per_step"] / summary["world_size"]
    return (f"| {strategy} | {fmt} | {sent:,.0f} | {summary['comm_matches_theory']} | {tail_mean(losses):.4f} | "
            f"{gap:+.5f} | {gap / tail_mean(ref):+.3%} | {worst:.5f} |")


def main(argv: list[str]) -> int:
    opts = options(argv, {"steps": "300", "model": "small", "world": "2", "strategies": "dp",
                            "seed": "1234"})
    print(f"{opts['steps']} steps of model={opts['model']} at world {opts['world']}; the loss is the mean of the "
          "last 10% of the steps; the gap is against the same strategy in fp32\n")
    print("| strategy | comm_dtype | bytes sent per rank per step | equal to the closed form | final loss | "
          "gap | relative gap | largest gap of a step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="lowprec_loss_") as tmp:
        for strategy in opts["strategies"].split(","):
            try:
                summaries = {fmt: one_run(strategy, fmt, opts, Path(tmp)) for fmt in FORMATS}
            except RunFailed as e:
                print(f"| {strategy} | failed: {e} |")
                return 1
            for fmt in FORMATS:
                print(row(strategy, fmt, summaries[fmt], summaries["fp32"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
