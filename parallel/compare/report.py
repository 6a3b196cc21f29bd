"""The comparison's files: results.json, results.csv (rounds.csv), report.md, and the console table.

The console table is the short one, at most CONSOLE_WIDTH (120) columns; report.md and results.csv
hold every column.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from parallel.compare import plots
from parallel.compare.rows import COLUMNS, LOSS_RTOL, NOISY_SPREAD
from parallel.compare.speedup import ABOVE_RANKS
from parallel.compare.verdict import caveats, opening

CONSOLE_WIDTH = 120


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _tokens(row: dict) -> str:
    text = f"{row['tokens_per_s']:.0f}"
    if row.get("tokens_per_s_lo") is None:
        return text
    return f"{text} ({row['tokens_per_s_lo']:.0f}-{row['tokens_per_s_hi']:.0f})"


def _ratio(row: dict) -> str:
    if row.get("ratio_to_baseline") is None:
        return "-"
    text = f"{row['ratio_to_baseline']:.2f}"
    return text if row.get("ratio_lo") is None else f"{text} ({row['ratio_lo']:.2f}-{row['ratio_hi']:.2f})"


def _tokens_short(row: dict) -> str:
    """The console's: the median and, with rounds, ± half the min-max range in % of it."""
    text = f"{row['tokens_per_s']:.0f}"
    if row.get("tokens_per_s_lo") is None:
        return text
    return f"{text} ±{(row['tokens_per_s_hi'] - row['tokens_per_s_lo']) / 2 / row['tokens_per_s']:.0%}"


def _ratio_short(row: dict) -> str:
    if row.get("ratio_to_baseline") is None:
        return "-"
    text = f"{row['ratio_to_baseline']:.2f}"
    return text if row.get("ratio_lo") is None else f"{text} ±{(row['ratio_hi'] - row['ratio_lo']) / 2:.2f}"


def _spread(row: dict) -> str:
    """The timed steps' spread; a '!' where it is above NOISY_SPREAD."""
    if row.get("spread") is None:
        return "-"
    return f"{row['spread']:.0%}" + ("!" if row["noisy"] else "")


def _speedup(row: dict) -> str:
    """The speed-up over single; '-' where withheld or not known, a '!' where above the row's ranks."""
    if row.get("speedup_vs_single") is None:
        return "-"
    return f"{row['speedup_vs_single']:.2f}" + ("!" if (row.get("speedup_note") or "").startswith(ABOVE_RANKS) else "")


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _num(fmt: str, scale: float = 1.0):
    return lambda value: "-" if value is None else fmt.format(value * scale)


# (header, row key, cell) of report.md's table: every figure of a row but the breakdown (its own table).
TABLE = (
    ("strategy", "strategy", str),
    ("layout dp x tp x pp", "layout", str),
    ("tokens/s", None, _tokens),
    ("vs torch", None, _ratio),
    ("x single", None, _speedup),
    ("step ms", "step_ms", _num("{:.1f}")),
    ("min-max ms", None, lambda r: f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}"),
    ("spread", None, _spread),
    ("MFU %", "mfu", _num("{:.1f}", 100)),
    ("MB/step", "bytes_per_step", _num("{:.3f}", 1e-6)),
    ("theory MB", "bytes_per_step_theory", _num("{:.3f}", 1e-6)),
    ("= theory", "matches_theory", _yes),
    ("exposed comm", "exposed_comm_share", _share),
    ("bubble", "bubble_share", _share),
    ("peak MB/rank", "peak_memory_mb_max", _num("{:.0f}")),
    ("final loss", "final_loss", _num("{:.4f}")),
    ("same as single", "same_losses_as_single", _yes),
    ("max rel diff", "max_rel_loss_diff", _num("{:.1e}")),
)
# The console's: what fits in 120 columns (intervals as ±; if a row is still too wide, the columns
# of CONSOLE_DROP go first, and the table says so).
CONSOLE = (
    ("strategy", "strategy", str),
    ("layout", "layout", str),
    ("tokens/s", None, _tokens_short),
    ("vs torch", None, _ratio_short),
    ("step ms", "step_ms", _num("{:.1f}")),
    ("spread", None, _spread),
    ("MFU%", "mfu", _num("{:.1f}", 100)),
    ("MB/step", "bytes_per_step", _num("{:.3f}", 1e-6)),
    ("=theory", "matches_theory", _yes),
    ("comm", "exposed_comm_share", _share),
    ("bubble", "bubble_share", _share),
    ("peak MB", "peak_memory_mb_max", _num("{:.0f}")),
    ("=single", "same_losses_as_single", _yes),
)
BREAKDOWN = (
    ("strategy", "strategy", str),
    ("step ms", "step_ms", _num("{:.1f}")),
    ("compute", "compute_ms", _num("{:.1f}")),
    ("exposed comm", "exposed_comm_ms", _num("{:.1f}")),
    ("bubble", "bubble_ms", _num("{:.1f}")),
    ("optimizer", "optimizer_ms", _num("{:.1f}")),
    ("other", "other_ms", _num("{:.1f}")),
)


def table_lines(rows: list[dict], columns=TABLE) -> list[list[str]]:
    lines = [[h for h, _, _ in columns]]
    for row in rows:
        if row["status"] != "ok":
            lines.append([row["strategy"], f"{row['status']}: {row['error']}"])
        else:
            lines.append([cell(row[key] if key else row) for _, key, cell in columns])
    return lines


CONSOLE_DROP = ("peak MB", "MFU%", "bubble", "=theory", "comm", "spread")


def console_table(rows: list[dict]) -> str:
    """Plain aligned text, at most CONSOLE_WIDTH wide: numbers right-aligned; a failed row prints its
    error across the line (cut at the width: the whole error is in results.csv)."""
    columns, dropped = list(CONSOLE), []
    text = _aligned(rows, columns)
    for header in CONSOLE_DROP:
        if max(len(line) for line in text.splitlines()) <= CONSOLE_WIDTH:
            break
        columns = [c for c in columns if c[0] != header]
        dropped.append(header)
        text = _aligned(rows, columns)
    if dropped:
        text += f"\n(left out to fit {CONSOLE_WIDTH} columns: {', '.join(dropped)}; every column is in report.md)"
    return text


def _aligned(rows: list[dict], columns: list) -> str:
    lines = table_lines(rows, columns)
    n = len(columns)
    widths = [max(len(line[i]) for line in lines if len(line) == n) for i in range(n)]
    out = []
    for line in lines:
        if len(line) != n:
            text = f"{line[0]:<{widths[0]}}  {line[1]}"
            out.append(text if len(text) <= CONSOLE_WIDTH else text[:CONSOLE_WIDTH - 3] + "...")
            continue
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        cells += [c.rjust(w) for c, w in zip(line[2:], widths[2:])]
        out.append(" ".join(cells))
    rule = "-" * len(out[0])
    return "\n".join([out[0], rule, *out[1:]])


def markdown_table(rows: list[dict], columns=TABLE) -> str:
    lines = table_lines(rows, columns)
    n = len(columns)
    head = "| " + " | ".join(lines[0]) + " |"
    align = "| " + " | ".join("---" if i < 2 else "---:" for i in range(n)) + " |"
    body = []
    for line in lines[1:]:
        if len(line) != n:
            line = [line[0], line[1].replace("|", "\\|")[:300]] + [""] * (n - 2)
        body.append("| " + " | ".join(line) + " |")
    return "\n".join([head, align, *body])


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in row.items()})


def write_json(path: Path, meta: dict, rows: list[dict], rounds: list[list[dict]] | None = None) -> None:
    content = {"meta": meta, "rows": rows}
    if rounds is not None:
        content["rounds"] = rounds
    path.write_text(json.dumps(content, indent=2) + "\n")


HOW_TO_READ = f"""\
How to read the columns (MB: 10^6 bytes, for traffic and memory alike):

- **layout**: dp x tp x pp ranks, `m` microbatches per step (per pipeline or per dp rank), `v` virtual
  stages per pipeline rank, `sp` sequence parallelism.
- **tokens/s**: global tokens per optimizer step / the median step time (warm-up steps excluded; a
  step lasts as long as its slowest rank). With `compare.rounds=N`: the median over the rounds, and
  in brackets the slowest and fastest round (min-max).
- **vs torch**: this row's tokens/s over its PyTorch counterpart's (dp, dp_naive -> torch_ddp;
  zero1 -> torch_zero1; zero2 -> torch_zero2; zero3 -> torch_fsdp2; tp, tp_sp -> torch_tp;
  pp_X -> torch_pp_X). Above 1: ours is faster. With rounds: the median of the per-round ratios
  (each pair from the same round) and their min-max. One run each is one sample: trust a difference
  only beyond the spread.
- **x single**: this row's tokens/s over `single`'s (same round), on the clock that ranks the sweep.
  In virtual time every run computes on one thread per rank, so each rank's device is one core and
  the ratio is per core; it is withheld (`-`) where this row's ranks and single had different
  devices (`train.threads` given: `speedup_note` says which), and marked `!` where it is above the
  row's ranks on one clock: then not the clock's doing (a rank computes less per token).
- **step ms**, **min-max ms**, **spread**: the median timed step, the fastest and slowest timed step
  (over every round), and (slowest - fastest) / median; `!` marks a spread above {NOISY_SPREAD:.0%}
  (`noisy` in results.csv): such a row's figure can move that much on a rerun.
- **MFU %**: model FLOPs per second (6N + 12·L·h·s per token, parallel/report/mfu.py) over the peak a
  matmul measured on this machine (all cores; per GPU on GPUs).
- **MB/step**, **theory MB**: bytes all ranks sent in one step (ring convention: an all-reduce of
  S bytes over N ranks sends 2(N-1)/N·S per rank), measured by the communication log, and
  the families' theory.py closed form; **= theory**: equal to the byte.
- **exposed comm**: share of the step a rank spent blocked in communication (not hidden behind
  compute), mean over ranks, from the communication log; `-` where PyTorch waits internally, out of
  the log's sight (DDP's comm hook futures; on GPUs, FSDP2's collectives on its own CUDA streams).
- **bubble**: share of one pipeline's rank x time in which no rank computed (measured from the
  ranks' timelines; our pipelines only).
- **peak MB/rank**: the largest rank's peak memory (RSS on CPU, which includes the Python and
  torch runtime, ~300 MB; allocator peak on GPU); every rank's in results.csv, and the model state
  and activations per rank in the memory plot.
- **final loss**, **same as single**: the last step's loss; whether every step's loss equals the
  single-process run's within {LOSS_RTOL:g} relative, and the largest relative difference.

Where the time goes (the breakdown table and plot, summary.json's `time_breakdown_s`): the median
timed step of each run split into compute (forward, backward), exposed communication, pipeline
bubble (waiting for a neighbour stage's p2p), optimizer and other, mean over ranks
(docs/observability.md).
"""


def write_markdown(path: Path, meta: dict, rows: list[dict], plots: dict[str, str], timelines: dict[str, str],
                   summaries: dict[str, dict], network_section: list[str] | None = None) -> None:
    """`network_section`: markdown lines on the emulated network the sweep ran on (after the table)."""
    rounds = meta.get("rounds", 1)
    parts = [
        "# Comparison of every strategy with PyTorch's own\n",
        " ".join(opening(rows, summaries, meta)) + "\n",
        *([" ".join(caveats(rows, meta)) + "\n"] if caveats(rows, meta) else []),
        f"Command: `{meta['command']}`\n",
        f"Model `{meta['model']}` ({meta['parameters']} parameters), {meta['steps']} steps "
        f"({meta['warmup_steps']}), global batch {meta['global_batch']} sequences of {meta['seq_len']} tokens; "
        f"world {meta['world']}; peak {meta['peak_flops']:.3g} FLOP/s per device ({meta['peak_source']}); "
        f"torch {meta['torch']}; {meta['device']}"
        + (f"; {rounds} rounds, orders {' | '.join(', '.join(o) for o in meta['orders'])}" if rounds > 1 else "")
        + ".\n",
        markdown_table(rows) + "\n",
        *(network_section or []),
        HOW_TO_READ,
        "## Where the time goes (ms per step, mean over ranks)\n",
        markdown_table([r for r in rows if r["status"] == "ok"], BREAKDOWN) + "\n",
    ]
    notes = {note for s in summaries.values() for note in (s.get("time_breakdown") or {}).get("notes", [])}
    parts += [f"- {note}" for note in sorted(notes)]
    if notes:
        parts.append("")
    for title, name in plots.items():
        parts.append(f"## {title}\n\n![{title}]({name})\n")
    if timelines:
        parts.append("## Timelines (every rank, last step)\n")
        for strategy, name in timelines.items():
            parts.append(f"### {strategy}\n\n![{strategy}]({name})\n")
    path.write_text("\n".join(parts))


FIGURES = {"Throughput": "tokens_per_s.png", "Where each step's time goes": "time_breakdown.png",
           "Bytes per step, by op and by group (theory marked)": "bytes_per_step.png",
           "Memory per rank: model state and activations, and peak process memory": "memory_per_rank.png"}


def write_report(out: Path, meta: dict, rows: list[dict], per_round: list[list[dict]], summaries: dict[str, dict],
                 run_dirs: dict[str, Path], network_section: list[str] | None = None) -> None:
    """Everything a sweep writes in `out`: results.json and results.csv (rounds.csv with rounds), the
    plots, each row's timeline (from its run's trace.json) and report.md."""
    rounds = len(per_round) > 1
    write_json(out / "results.json", meta, rows, per_round if rounds else None)
    write_csv(out / "results.csv", rows)
    if rounds:
        write_csv(out / "rounds.csv", [row for rows_k in per_round for row in rows_k])
    names = iter(FIGURES.values())
    plots.tokens_per_s(rows, out / next(names))
    plots.time_breakdown(rows, out / next(names))
    plots.bytes_per_step(rows, summaries, out / next(names))
    plots.memory_per_rank(rows, summaries, out / next(names))
    timelines = plots.timelines(summaries, run_dirs, out)
    write_markdown(out / "report.md", meta, rows, FIGURES, timelines, summaries, network_section)
