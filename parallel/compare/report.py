"""The comparison's files: results.json, results.csv, report.md, and the console table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from parallel.compare.rows import COLUMNS, LOSS_RTOL

# (header, row key, format) of the table shown on the console and in report.md.
TABLE = (
    ("strategy", "strategy", "{}"),
    ("layout dp x tp x pp", "layout", "{}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("vs torch", "ratio_to_baseline", "{:.2f}"),
    ("step ms", "step_ms", "{:.1f}"),
    ("MFU %", "mfu", "{:.1%}"),
    ("MB/step", "bytes_per_step", "{:.3f}"),
    ("theory MB", "bytes_per_step_theory", "{:.3f}"),
    ("= theory", "matches_theory", "{}"),
    ("exposed comm", "exposed_comm_share", "{:.0%}"),
    ("bubble", "bubble_share", "{:.0%}"),
    ("peak MB/rank", "peak_memory_mb_max", "{:.0f}"),
    ("final loss", "final_loss", "{:.4f}"),
    ("same as single", "same_losses_as_single", "{}"),
    ("max rel diff", "max_rel_loss_diff", "{:.1e}"),
)


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if key in ("mfu",):
        return f"{100 * value:.1f}"
    if key in ("bytes_per_step", "bytes_per_step_theory"):
        return f"{value / 1e6:.3f}"
    return fmt.format(value)


def table_lines(rows: list[dict]) -> list[list[str]]:
    lines = [[h for h, _, _ in TABLE]]
    for row in rows:
        if row["status"] != "ok":
            lines.append([row["strategy"], f"{row['status']}: {row['error']}"])
        else:
            lines.append([cell(row, key, fmt) for _, key, fmt in TABLE])
    return lines


def console_table(rows: list[dict]) -> str:
    """Plain aligned text: numbers right-aligned; a failed row prints its error across the line."""
    lines = table_lines(rows)
    widths = [max(len(line[i]) for line in lines if len(line) == len(TABLE)) for i in range(len(TABLE))]
    out = []
    for line in lines:
        if len(line) != len(TABLE):
            out.append(f"{line[0]:<{widths[0]}}  {line[1]}")
            continue
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(line[2:], widths[2:])]
        out.append("  ".join(cells))
    rule = "-" * len(out[0])
    return "\n".join([out[0], rule, *out[1:]])


def markdown_table(rows: list[dict]) -> str:
    lines = table_lines(rows)
    head = "| " + " | ".join(lines[0]) + " |"
    align = "| " + " | ".join("---" if i < 2 else "---:" for i in range(len(TABLE))) + " |"
    body = []
    for line in lines[1:]:
        if len(line) != len(TABLE):
            line = [line[0], line[1].replace("|", "\\|")[:300]] + [""] * (len(TABLE) - 2)
        body.append("| " + " | ".join(line) + " |")
    return "\n".join([head, align, *body])


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in row.items()})


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


HOW_TO_READ = f"""\
How to read the columns:

- **layout**: dp x tp x pp ranks, `m` microbatches per step (per pipeline or per dp rank), `v` virtual
  stages per pipeline rank, `sp` sequence parallelism.
- **tokens/s**: global tokens per optimizer step / the median step time (warm-up steps excluded; a
  step lasts as long as its slowest rank).
- **vs torch**: this row's tokens/s over its PyTorch counterpart's in the same sweep (dp, dp_naive,
  zero1, zero2 -> torch_ddp; zero3 -> torch_fsdp2; tp, tp_sp -> torch_tp; pp_X -> torch_pp_X).
  Above 1: ours is faster. One short run each, on a shared machine: read differences under ~10% as noise.
- **step ms**: that median step time.
- **MFU %**: model FLOPs per second (6N + 12·L·h·s per token, parallel/report/mfu.py) over the peak a
  matmul measured on this machine (all cores; per GPU on GPUs).
- **MB/step**, **theory MB**: bytes all ranks sent in one step (ring convention: an all-reduce of
  S bytes over N ranks sends 2(N-1)/N·S per rank), measured by the communication log, and
  parallel/theory.py's closed form; **= theory**: equal to the byte.
- **exposed comm**: share of the step a rank spent blocked in communication (not hidden behind
  compute), mean over ranks; `-` where PyTorch waits internally, out of the log's sight
  (DDP's comm hook futures, torch pipelining's own waits).
- **bubble**: share of the pipeline's rank x time in which no rank computed (measured from the
  ranks' timelines; our pipelines only).
- **peak MB/rank**: the largest rank's peak memory (RSS on CPU, which includes the Python and
  torch runtime, ~300 MB; allocator peak on GPU); every rank's in results.csv.
- **final loss**, **same as single**: the last step's loss; whether every step's loss equals the
  single-process run's within {LOSS_RTOL:g} relative, and the largest relative difference.
"""


def write_markdown(path: Path, meta: dict, rows: list[dict], plots: dict[str, str], timelines: dict[str, str]) -> None:
    parts = [
        "# Comparison of every strategy with PyTorch's own\n",
        f"Command: `{meta['command']}`\n",
        f"Model `{meta['model']}` ({meta['parameters']} parameters), {meta['steps']} steps "
        f"({meta['warmup_steps']} warm-up), global batch {meta['global_batch']} sequences of {meta['seq_len']} tokens; "
        f"world {meta['world']}; peak {meta['peak_flops']:.3g} FLOP/s per device ({meta['peak_source']}); "
        f"torch {meta['torch']}; {meta['device']}.\n",
        markdown_table(rows) + "\n",
        HOW_TO_READ,
    ]
    for title, name in plots.items():
        parts.append(f"## {title}\n\n![{title}]({name})\n")
    if timelines:
        parts.append("## Pipeline timelines (last step)\n")
        for strategy, name in timelines.items():
            parts.append(f"### {strategy}\n\n![{strategy}]({name})\n")
    path.write_text("\n".join(parts))
