"""What does DiLoCo cost in loss, at equal tokens, against dp, and what does it save in bytes?

    python -m bench.diloco_loss                                   # model=small, world 2, 300 steps: dp, H=10, H=50
    python -m bench.diloco_loss steps=300 hs=10,50 fragments=1 world=2 model=small
    python -m bench.diloco_loss steps=6 hs=2 model=tiny           # a short check that it runs

Every variant is one `launch.train` run of the same global batches (the same seed, the same
global batch: equal tokens at every step), dp with AdamW, then `parallel=diloco` with the same
inner AdamW at each H (the preset's outer SGD: rate 0.7, Nesterov momentum 0.9; `fragments` > 1
streams). A step's loss is the mean over the global batch of each worker's loss on its own model
(DiLoCo's workers differ between syncs), so the table gives the mean of the last `tail` steps'
losses, the gap to dp's, and the bytes each rank sent per step over the run (the communication
log's, warm-up included), against dp's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.harness import RunFailed, options, run, shown, train_command

RUN = ["train.warmup_steps=1", "train.global_batch=16", "train.peak_flops=1e11", "run.timeline=false",
       "virtual.loopback_gbytes_per_s=1.62", "virtual.loopback_latency_us=180", "virtual.loopback_p2p_latency_us=127"]


def run_variant(name: str, overrides: list[str], world: int, root: Path) -> dict:
    cmd = train_command(world, [*RUN, *overrides], root / name)
    print(f"running {name}: {shown(cmd)}", file=sys.stderr, flush=True)
    try:
        return run(cmd, root / name, timeout_s=24 * 3600)  # 300 steps of `small` on a loaded host: hours, not minutes
    except RunFailed as failed:
        raise SystemExit(f"{name} failed: {failed}") from None


def main(argv: list[str]) -> int:
    opts = options(argv, {"steps": "300", "hs": "10,50", "fragments": "1", "world": "2", "model": "small",
                          "tail": "20"})
    steps, world, tail = int(opts["steps"]), int(opts["world"]), min(int(opts["tail"]), int(opts["steps"]))
    common = [f"model={opts['model']}", f"train.steps={steps}"]
    variants = [("dp", ["parallel=dp"])] + [
        (f"diloco H={h}" + (f" F={opts['fragments']}" if opts["fragments"] != "1" else ""),
         ["parallel=diloco", f"parallel.inner_steps={h}", f"parallel.fragments={opts['fragments']}"])
        for h in opts["hs"].split(",")]
    with tempfile.TemporaryDirectory(prefix="diloco_loss_") as tmp:
        summaries = {name: run_variant(f"variant{i}", [*common, *extra], world, Path(tmp))
                     for i, (name, extra) in enumerate(variants)}
    dp = summaries["dp"]
    dp_loss, dp_bytes = _tail_loss(dp, tail), _bytes_per_rank_step(dp, world)
    tokens = steps * dp["config"]["train"]["global_batch"] * dp["config"]["model"]["seq_len"]
    print(f"\nmodel={opts['model']}, world {world}, {steps} steps ({tokens} tokens, "
          f"the same for every variant), loss: the mean of the last {tail} steps\n")
    print("| variant | loss | gap to dp | bytes per rank per step | dp's bytes / these |")
    print("| --- | --- | --- | --- | --- |")
    for name, s in summaries.items():
        loss, sent = _tail_loss(s, tail), _bytes_per_rank_step(s, world)
        print(f"| {name} | {loss:.4f} | {loss - dp_loss:+.4f} | {sent:,.0f} | "
              f"{dp_bytes / sent if sent else float('inf'):.1f} |")
    return 0


def _tail_loss(summary: dict, tail: int) -> float:
    return sum(summary["losses"][-tail:]) / tail


def _bytes_per_rank_step(summary: dict, world: int) -> float:
    run_comm = summary["comm"]["run"]
    return run_comm["sent_bytes"] / run_comm["steps"] / world


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
