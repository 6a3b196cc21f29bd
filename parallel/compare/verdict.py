"""The sentences report.md opens with, written from the sweep's numbers.

Three sentences, as a person reading the tables would put them:

1. the fastest layout, its throughput and its ratio to PyTorch's counterpart;
2. what each of the others waits on: its largest share of non-compute time (exposed communication,
   with the op and group that dominate it, or the pipeline bubble) where that share is at least
   WAIT_SHARE of its step; the others are "mostly computing";
3. what would change the ranking: whether the runner-up would overtake the fastest if its waiting
   were hidden behind compute, or that the two are within each other's noise (then the order is
   not established), or that the runner-up computes more (then only less compute changes it).

Then, where they apply, `caveats`: which rows ran more ranks than the machine has cores (or GPUs),
whose speed-up over single is withheld or above its ranks (parallel/compare/speedup.py), and which
were noisy.
"""

from __future__ import annotations

from parallel.compare.rows import NOISY_SPREAD

WAIT_SHARE = 0.10  # below this share of its step, a strategy is not said to wait on anything
WAIT_NAMES = {"exposed_comm": "exposed communication", "bubble": "the pipeline bubble"}


def _top_comm(summary: dict | None) -> str:
    """The op and group of the most exposed communication ("all_reduce tp"), or ""."""
    exposed = ((summary or {}).get("time_breakdown") or {}).get("exposed_comm_s") or {}
    return max(exposed, key=exposed.get) if exposed else ""


def main_wait(row: dict, summary: dict | None) -> tuple[str, float, str] | None:
    """(category, share of the step, detail) of what this row waits on most, or None."""
    if row.get("compute_ms") is None:
        return None
    waits = {name: (row[f"{name}_ms"] or 0.0) / row["step_ms"] for name in WAIT_NAMES}
    name = max(waits, key=waits.get)
    if waits[name] < WAIT_SHARE:
        return None
    return name, waits[name], _top_comm(summary) if name == "exposed_comm" else ""


def _ratio_text(row: dict) -> str:
    if row.get("ratio_to_baseline") is None:
        return ""
    text = f", {row['ratio_to_baseline']:.2f}x its PyTorch counterpart {row['baseline']}"
    if row.get("ratio_lo") is not None:
        text += f" ({row['ratio_lo']:.2f}-{row['ratio_hi']:.2f} over the rounds)"
    return text


def _within_noise(a: dict, b: dict) -> bool:
    """Whether two rows' measurements overlap: their round intervals of tokens/s (with rounds), or
    else their timed steps' ranges."""
    if a.get("tokens_per_s_lo") is not None and b.get("tokens_per_s_lo") is not None:
        return b["tokens_per_s_hi"] >= a["tokens_per_s_lo"]
    return b["step_ms_min"] <= a["step_ms_max"]


def _waits_sentence(ranked: list[dict], summaries: dict[str, dict]) -> str:
    groups: dict[str, list[str]] = {}
    unmeasured, computing = [], []
    for row in ranked[1:]:
        wait = main_wait(row, summaries.get(row["strategy"]))
        if wait is None:
            # A row whose waits happen inside PyTorch (exposed comm unmeasured: DDP) may only look busy.
            (unmeasured if row.get("exposed_comm_share") is None else computing).append(row["strategy"])
            continue
        name, share, detail = wait
        groups.setdefault(name, []).append(f"{row['strategy']} ({share:.0%} of its step" +
                                           (f", mostly {detail})" if detail else ")"))
    parts = [f"on {WAIT_NAMES[name]}: {', '.join(items)}" for name, items in groups.items()]
    if computing:
        parts.append(f"{', '.join(computing)} mostly compute{'s' if len(computing) == 1 else ''}")
    if unmeasured:
        parts.append(f"{', '.join(unmeasured)} wait{'s' if len(unmeasured) == 1 else ''} inside PyTorch, out of the "
                     "log's sight (counted as compute)")
    if not parts:
        return ""
    return "The others wait " + "; ".join(parts) + "."


def _ranking_sentence(best: dict, runner: dict) -> str:
    b, r = best["strategy"], runner["strategy"]
    if _within_noise(best, runner):
        how = "their round intervals overlap" if best.get("tokens_per_s_lo") is not None else (
            f"timed steps {best['step_ms_min']:.0f}-{best['step_ms_max']:.0f} ms against "
            f"{runner['step_ms_min']:.0f}-{runner['step_ms_max']:.0f} ms")
        return (f"{b} and the runner-up {r} are within each other's noise ({how}): their order is not established; "
                "repeat with compare.rounds=3 (or more steps) before trusting it.")
    if runner.get("compute_ms") is None:
        return f"The runner-up is {r} at {runner['step_ms']:.0f} ms per step against {best['step_ms']:.0f} ms."
    waits = (runner["exposed_comm_ms"] or 0.0) + (runner["bubble_ms"] or 0.0)
    without = runner["step_ms"] - waits
    if without < best["step_ms"]:
        return (f"The runner-up {r} would overtake it if its {waits:.0f} ms of communication and bubble per step were "
                f"hidden behind compute ({runner['step_ms']:.0f} -> {without:.0f} ms against "
                f"{best['step_ms']:.0f} ms).")
    return (f"The runner-up {r} would stay behind even with all its waiting hidden ({without:.0f} ms of its "
            f"{runner['step_ms']:.0f} ms is its own work, against {best['step_ms']:.0f} ms): only less compute per "
            "rank (or a core per rank) changes the order.")


def opening(rows: list[dict], summaries: dict[str, dict], meta: dict) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    if not ok:
        return ["No strategy ran: every row below holds its error."]
    ranked = sorted(ok, key=lambda r: -r["tokens_per_s"])
    best = ranked[0]
    sentences = [f"The fastest layout is **{best['strategy']}** ({best['layout']}, world {best['world']}) at "
                 f"{best['tokens_per_s']:.0f} tokens/s, {best['step_ms']:.0f} ms per step{_ratio_text(best)}."]
    waits = _waits_sentence(ranked, summaries)
    if waits:
        sentences.append(waits)
    if len(ranked) > 1:
        sentences.append(_ranking_sentence(best, ranked[1]))
    return sentences


def caveats(rows: list[dict], meta: dict) -> list[str]:
    """Oversubscribed and noisy rows, in words (the paragraph after the opening)."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = [meta["clock_sentence"]] if meta.get("clock_sentence") else []
    over = [r["strategy"] for r in ok if r.get("oversubscribed")]
    if over:
        out.append(f"Oversubscribed: {', '.join(over)} ran more ranks than this machine has {meta['capacity_unit']} "
                   f"({meta['capacity']}): ranks took turns, so their step times include waiting for one, and their "
                   "speed against a single process is not what one per rank would give.")
    notes = [f"{r['strategy']} ({r['speedup_note']})" for r in ok if r.get("speedup_note")]
    if notes:
        out.append(f"Speed-up over single: {'; '.join(notes)}.")
    noisy = [r["strategy"] for r in ok if r.get("noisy")]
    if noisy:
        out.append(f"Noisy (timed steps spread more than {NOISY_SPREAD:.0%} of the median): {', '.join(noisy)}.")
    return out
