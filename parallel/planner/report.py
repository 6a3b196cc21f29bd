"""The plan's outputs: the ranked table (console and report.md), plan.json, and the plots."""

from __future__ import annotations

import json
from pathlib import Path

from parallel.registry import label

GIB = 2**30



def _virtual_cell(figures: dict, key: str, fmt: str) -> str:
    """" (virtual x)": the replay's figure beside the wall one (parallel/replay/), where the run has it."""
    value = figures.get(key)
    return "" if value is None else f" (virtual {value:{fmt}})"

def layout_label(layout: dict) -> str:
    """`2x4x8 m16x1 sp 1f1b v2 zero1`: dp x tp x pp (x cp, ep, dp_shard where used), microbatches, the
    families' options."""
    dims = f"{layout['dp']}x{layout['tp']}x{layout['pp']}"
    for carved in ("cp", "ep", "dp_shard"):
        if layout.get(carved, 1) > 1:
            dims += f" {carved}{layout[carved]}"
    parts = [dims, f"m{layout['microbatches']}x{layout['microbatch_size']}", *label(layout)]
    if layout.get("recompute") not in (None, "none"):
        parts.append(f"rc-{layout['recompute']}")
    return " ".join(parts)


def _gib(x) -> str:
    if x is None:
        return "-"
    return f"{x / GIB:.1f}" if x >= 10 * GIB else f"{x / GIB:.3g}"


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.3g}"


def _s(x) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.3g}" if x >= 0.01 else f"{x * 1e3:.3g}m"


HEADER = ["#", "preset", "layout dp x tp x pp", "mem GiB", "params/grads/optim/acts/buf GiB", "fits",
          "intra GB", "inter GB", "step s", "compute/comm/bubble s", "tokens/s", "MFU %"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        mem, t = row["memory_bytes_per_device"], row["step_time_s"]
        fits = {True: "yes", None: "?"}.get(row["fits"], f"no, +{_gib(row['over_bytes'])}")
        out.append([
            str(row["rank"]), row["layout"]["preset"] or row["layout"]["strategy"], layout_label(row["layout"]),
            _gib(mem["total"]),
            "/".join(_gib(mem[k]) for k in ("params", "grads", "optimizer", "activations", "buffers")),
            fits,
            _gb(row["bytes_per_step"]["intra_node"]) if row["bytes_per_step"] else "-",
            _gb(row["bytes_per_step"]["inter_node"]) if row["bytes_per_step"] else "-",
            _s(t["total"]) if t else "-",
            "/".join(_s(t[k]) for k in ("compute", "exposed_comm", "bubble")) if t else "-",
            f"{row['tokens_per_s']:.4g}" if row["tokens_per_s"] else "-",
            f"{100 * row['mfu']:.1f}" if row["mfu"] is not None else "-",
        ])
    return out


def shown(rows: list[dict], top: int) -> list[dict]:
    """The best `top` rows, and the closest misses among those that do not fit (so a table of a
    model that fits nowhere still says by how much)."""
    best = rows[:top]
    misses = [r for r in rows if r["fits"] is False and r not in best][: max(3, top // 4)]
    return best + misses


def console_table(rows: list[dict], top: int) -> str:
    body = table_rows(shown(rows, top))
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def markdown_table(rows: list[dict], top: int) -> str:
    body = table_rows(shown(rows, top))
    lines = ["| " + " | ".join(HEADER) + " |", "| " + " | ".join("---" for _ in HEADER) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def write_markdown(path: Path, meta: dict, rows: list[dict], top: int, plots: list[str],
                   validation: list[dict] | None = None) -> None:
    cluster, model = meta["cluster"], meta["model"]
    fitting = sum(1 for r in rows if r["fits"])
    lines = [
        f"# Plan: {model['preset']} on {meta['world']} x {cluster['name']}",
        "",
        f"{model['parameters'] / 1e9:.3g}B parameters ({model['description']}); global batch {meta['global_batch']} "
        f"sequences of {model['seq_len']} tokens ({meta['tokens_per_step']:,} tokens per step); "
        f"{meta['precision']} training. {len(rows)} valid layouts kept ({fitting} that fit in "
        f"{cluster['usable_gib']:.1f} GiB usable per device, the fastest of them exactly the search's best; the "
        f"rest over it), {meta['refused_total']} requests "
        "refused by "
        f"run_plan.py's rules, {meta.get('pruned', 0) + meta.get('heavy', 0)} not asked (a floor under their memory, "
        "their model state alone or their first pipeline rank's, is over the device); "
        "layouts over the device are not timed.",
        "",
        markdown_table(rows, top),
        "",
        "How to read it: **mem** is the device that holds the most (a pipeline's first stage, usually), split into "
        "parameters / gradients / optimizer state / saved activations / transient buffers; **fits** compares it "
        "with the usable memory (capacity less the runtime, less the headroom); **intra/inter GB** are all ranks' "
        "bytes per optimizer step on links inside a node and between nodes (the closed forms); **step s** "
        "splits into compute, exposed communication and pipeline bubble.",
        "",
    ]
    if validation:
        order = meta.get("validation", {})
        lines += ["## Validation: predicted against measured", "", markdown_validation(validation), ""]
        if order:
            lines += [f"Fastest first, predicted (by rank): {order['predicted_order']}; measured: "
                      f"{order['measured_order']} ({'the same order' if order['same'] else 'not the same order'}).", ""]
    lines += ["## Assumptions", ""] + [f"- **{k}**: {v}" for k, v in meta["assumptions"].items()] + [""]
    if meta.get("refused"):
        lines += ["## Refused by run_plan.py (requests per rule)", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(meta["refused"].items(), key=lambda kv: -kv[1])[:12]]
        lines += [""]
    lines += [f"![{p}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


# -- the validation table: the planner's prediction beside a measured run (parallel/planner/validate.py) --
VALIDATION_HEADER = ["#", "layout", "step s pred", "step s meas", "err", "exposed comm pred/meas s",
                     "bubble pred/meas", "MB/step = theory", "acts max err", "state err"]


def markdown_validation(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(VALIDATION_HEADER) + " |", "| " + " | ".join("---" for _ in VALIDATION_HEADER) + " |"]
    for r in rows:
        if r.get("measured_error"):
            lines.append(f"| {r['rank']} | {r['layout']['preset']} {layout_label(r['layout'])} | "
                         f"run failed: {r['measured_error']} |" + " |" * (len(VALIDATION_HEADER) - 3))
            continue
        m, e, t = r["measured"], r["errors"], r["step_time_s"]
        bubble = "-" if m["bubble_fraction"] is None else f"{t['bubble'] / t['total']:.0%}/{m['bubble_fraction']:.0%}"
        acts = "-" if e["activations"] is None else f"{e['activations']:.1%}"
        state = "-" if e["model_state"] is None else f"{e['model_state']:+.1%}"
        same = "yes" if e["bytes_equal"] else "NO"
        lines.append(
            f"| {r['rank']} | {r['layout']['preset']} {layout_label(r['layout'])} | {t['total']:.3f} | "
            f"{m['step_time_s']:.3f}{_virtual_cell(m, 'virtual_step_time_s', '.3f')} | {e['step_time']:+.0%}"
            f"{_virtual_cell(e, 'virtual_step_time', '+.0%')} | {t['exposed_comm']:.3f}/{m['exposed_comm_s']:.3f} | "
            f"{bubble} | {m['sent_bytes_per_step'] / 1e6:.3f} {same} | {acts} | {state} |")
    return "\n".join(lines)
