"""launch/gpu_check.sh's last step: one line of figures per run, and each run's losses against the
single run's.

    python -m launch.gpu_check_figures <results dir>

Every summary.json under the results directory gets a line: its device, precision, tokens per
second, step time, peak memory, MFU, whether its logged bytes equal the closed form, and its
virtual step (`skipped` on a GPU, where the virtual clock does not apply). Then a
verdict line (`PASS` or `FAIL`, the run's name, the figure) for each multi-rank run trained in
fp32 on the same data as `single_fp32`: its per-step losses within 1e-5 relative of the single
run's, the project's rule for every strategy (the same data and initialisation, summed in another
order). The shell script counts the verdict lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parallel.compare.rows import LOSS_RTOL, max_rel_diff

REFERENCE = "single_fp32"


def figures_line(name: str, summary: dict) -> str:
    mfu = summary.get("mfu")
    mfu = mfu.get("mfu") if isinstance(mfu, dict) else mfu
    mfu_text = "" if mfu is None else f"{100 * mfu:.1f}%"
    return (f"{name:<26} {summary['strategy']:<10} {summary['world_size']:>5} {summary.get('device', '?'):<6} "
            f"{summary.get('precision', '?'):<5} {summary['tokens_per_s']:>10.0f} {summary['step_time_s'] * 1e3:>9.1f} "
            f"{summary['peak_memory_bytes'] / 2**20:>8.1f} {mfu_text:>6} {str(summary.get('comm_matches_theory')):>12} "
            f"{virtual_text(summary.get('virtual')):>10}")


def virtual_text(virtual: dict | None) -> str:
    if not virtual:
        return "-"
    if "skipped" in virtual:
        return "skipped"
    return f"{virtual['step_time_s'] * 1e3:.1f} ms" if "step_time_s" in virtual else "error"


def loss_verdict(name: str, losses: list[float], reference: list[float]) -> str:
    diff = max_rel_diff(losses, reference)
    if diff is None:
        return f"FAIL losses_{name} {len(losses)} losses against single's {len(reference)}"
    word = "PASS" if diff <= LOSS_RTOL else "FAIL"
    return f"{word} losses_{name} within {diff:.1e} of single over {len(losses)} steps (tolerance {LOSS_RTOL:.0e})"


def main(root: Path) -> int:
    summaries = {str(p.parent.relative_to(root)): json.loads(p.read_text()) for p in sorted(root.rglob("summary.json"))}
    print(f"{'run':<26} {'strategy':<10} {'world':>5} {'device':<6} {'prec':<5} {'tokens/s':>10} {'step ms':>9} "
          f"{'peak MiB':>8} {'MFU':>6} {'bytes=theory':>12} {'virtual':>10}")
    for name, summary in summaries.items():
        print(figures_line(name, summary))
    reference = summaries.get(REFERENCE)
    for name, summary in summaries.items():
        trained = "/" not in name and "replayed_from" not in summary  # not a compare's row, not a replay
        if trained and summary["world_size"] > 1 and summary.get("precision") == "fp32":
            if reference is None:
                print(f"FAIL losses_{name} no {REFERENCE} run to compare with")
            else:
                print(loss_verdict(name, summary["losses"], reference["losses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
