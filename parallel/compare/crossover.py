"""The sweep once per network (`compare.nets`): one table, one plot, one report across networks.

    results.csv / results.json   every row of every network (its `network` column says which)
    crossover.png                tokens/s per strategy against the inter-node bandwidth; beside it, each
                                 strategy's final loss against its inter-node bytes per step (tradeoff.py)
    report.md                    the tokens/s table (strategy x network, then the bytes per step on each
                                 class of link and the loss after the sweep's tokens), the plot, and per network the
                                 best layout and what the others wait on (networks.network_verdict);
                                 each network's own full report is in <network>/report.md

In the plot a network without shaped inter-node links (`none`: this machine's loopback) stands at
the right end, marked "unshaped". Networks that differ in more than their inter-node rate (world,
ranks per node, placement, intra-node rate) are separate series, each with its own line style, so
a line only ever joins runs of the same layout on different links.
"""

from __future__ import annotations

from pathlib import Path

from parallel.compare.networks import Network, best_layout, network_verdict
from parallel.compare.report import write_csv, write_json
from parallel.compare.tradeoff import extra_columns, loss_panel

STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D"]


def _family(network: Network) -> tuple:
    """What a network is apart from its inter-node rate: runs on networks of one family have the same layout."""
    s = network.spec
    if not network.emulated:
        return (network.world,)
    return (network.world, s.nodes, s.procs_per_node, s.placement, s.intra_mbit)


def _family_name(network: Network) -> str:
    s = network.spec
    if not network.emulated:
        return f"world {network.world}"
    text = f"{s.nodes} x {s.procs_per_node}"
    if s.procs_per_node > 1:
        text += f", intra {s.intra_mbit:g} Mbit/s" if s.intra_mbit else ", intra unshaped"
    return text + (f", {s.placement}" if s.placement != "block" else "")


def crossover_plot(results: list[tuple[Network, list[dict]]], path: Path) -> None:
    """tokens/s per strategy (colour) against each network's inter-node Mbit/s (log scale); one line
    style per family of networks; the unshaped loopback at the right end; error bars: rounds' min-max."""
    from parallel.compare.plots import _pyplot

    plt = _pyplot()
    finite = sorted({n.spec.inter_mbit for n, _ in results if n.emulated and n.spec.inter_mbit})
    unshaped_x = finite[-1] * 4 if finite else 1000.0

    def x_of(network: Network) -> float:
        return network.spec.inter_mbit if network.emulated and network.spec.inter_mbit else unshaped_x

    # One-process runs (single, the loss reference) use no link: drawn as one level, the median of
    # their runs, not as a line that would wander with the machine's load from network to network.
    alone = {r["strategy"] for _, rows in results for r in rows if (r.get("world") or 1) == 1}
    strategies = [s for s in dict.fromkeys(r["strategy"] for _, rows in results for r in rows) if s not in alone]
    families = list(dict.fromkeys(_family(n) for n, _ in results if n.emulated)) or [()]
    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    if not loss_panel(right, plt.get_cmap("tab10"), results, _family, _family_name, strategies):
        right.remove()  # no link counters (net=none alone): the throughput panel only
    for f, family in enumerate(families):
        # Each family's networks, and the unshaped loopback of the same world (its right end).
        members = [(n, rows) for n, rows in results
                   if _family(n) == family or (not n.emulated and (not family or n.world == family[0]))]
        _draw_family(ax, plt.get_cmap("tab10"), members, strategies, x_of, f)
    for strategy in sorted(alone):
        runs = sorted(r["tokens_per_s"] for _, rows in results for r in rows
                      if r["strategy"] == strategy and r["status"] == "ok" and r.get("tokens_per_s"))
        if runs:
            ax.axhline(runs[len(runs) // 2], color="gray", linestyle=":", linewidth=1.2,
                       label=f"{strategy} (one process, no links)")
    _label_axes(ax, plt, results, finite, unshaped_x, families)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def _draw_family(ax, colors, members: list[tuple[Network, list[dict]]], strategies: list[str], x_of,
                 f: int) -> None:
    """One line per strategy over the networks of family number `f`, in that family's style, with
    each point's min-max over the rounds; the legend names each strategy once (its first line)."""
    style, marker = STYLES[f % len(STYLES)], MARKERS[f % len(MARKERS)]
    for s, strategy in enumerate(strategies):
        points = []
        for network, rows in members:
            row = next((r for r in rows if r["strategy"] == strategy and r["status"] == "ok"), None)
            if row is not None:
                points.append((x_of(network), row["tokens_per_s"], row.get("tokens_per_s_lo"),
                               row.get("tokens_per_s_hi")))
        if not points:
            continue
        points.sort()
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        named = strategy in ax.get_legend_handles_labels()[1]  # a strategy skipped in family 0 is named later
        ax.plot(xs, ys, linestyle=style, marker=marker, color=colors(s % 10), label=None if named else strategy)
        for x, _, lo, hi in points:
            if lo is not None:
                ax.plot([x, x], [lo, hi], color=colors(s % 10), linewidth=1, alpha=0.6)


def _label_axes(ax, plt, results: list[tuple[Network, list[dict]]], finite: list[float], unshaped_x: float,
                families: list[tuple]) -> None:
    """The log-scale bandwidth axis (the unshaped loopback last), the clock of the tokens/s axis, and
    the legend: the strategies, then one line style per family of networks where there are several."""
    ax.set_xscale("log")
    ticks = finite + ([unshaped_x] if any(not n.emulated or not n.spec.inter_mbit for n, _ in results) else [])
    ax.set_xticks(ticks, [f"{t:g}" for t in finite] + (["unshaped"] if len(ticks) > len(finite) else []))
    ax.minorticks_off()
    ax.set_xlabel("inter-node link, Mbit/s each way (log scale)")
    clocks = sorted({r.get("clock") or "wall" for _, rows in results for r in rows if r["status"] == "ok"})
    # Each point is in its row's leading clock: virtual where ranks outnumber cores, else wall.
    ax.set_ylabel("tokens/s (" + " or ".join("virtual time" if c == "virtual" else "wall clock" for c in clocks) + ")")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput against the inter-node bandwidth")
    handles, labels = ax.get_legend_handles_labels()
    if len(families) > 1:
        for f, family in enumerate(families):
            name = _family_name(next(n for n, _ in results if n.emulated and _family(n) == family))
            handles.append(plt.Line2D([], [], color="black", linestyle=STYLES[f % len(STYLES)],
                                      marker=MARKERS[f % len(MARKERS)]))
            labels.append(name)
    ax.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)


def tokens_table(results: list[tuple[Network, list[dict]]], tokens: int | None = None) -> str:
    """Markdown: one row per strategy, one column per network, tokens/s (with rounds: median and min-max)
    in the leading clock with the other beside it; the fastest of each network in bold. Then the bytes
    per step on each class of link per family of networks, and the loss after `tokens` (tradeoff.py)."""
    strategies = list(dict.fromkeys(r["strategy"] for _, rows in results for r in rows))
    extra_heads, extra = extra_columns(results, _family, _family_name, tokens)
    head = "| strategy | " + " | ".join([n.label for n, _ in results] + extra_heads) + " |"
    lines = [head, "| --- |" + " ---: |" * (len(results) + len(extra_heads))]
    best = {}
    for network, rows in results:
        ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
        best[network.label] = best_layout(ok)["strategy"] if ok else None
    for strategy in strategies:
        cells = []
        for network, rows in results:
            row = next((r for r in rows if r["strategy"] == strategy), None)
            if row is None or row["status"] != "ok":
                cells.append("-" if row is None else row["status"])
                continue
            text = f"{row['tokens_per_s']:.0f}"
            if row.get("tokens_per_s_lo") is not None:
                text += f" ({row['tokens_per_s_lo']:.0f}-{row['tokens_per_s_hi']:.0f})"
            text = f"**{text}**" if best[network.label] == strategy else text
            if row.get("clock") == "virtual" and row.get("wall_tokens_per_s"):
                text += f" / {row['wall_tokens_per_s']:.0f} wall"  # the other clock beside the leading one
            elif row.get("clock") == "wall" and row.get("virtual_tokens_per_s") and row.get("world", 1) > 1:
                text += f" wall / {row['virtual_tokens_per_s']:.0f} virtual"
            cells.append(text)
        lines.append(f"| {strategy} | " + " | ".join(cells + extra.get(strategy, [])) + " |")
    clocks = {r.get("clock") for _, rows in results for r in rows if r["status"] == "ok"}
    if "virtual" in clocks:
        lines.append("\ntokens/s in virtual time (a device per rank), the wall clock's beside it "
                     "(where a network has a core per rank, the wall clock leads and virtual time is beside it)")
    return "\n".join(lines)


def console_lines(results: list[tuple[Network, list[dict]]]) -> list[str]:
    """Per network, one line: the fastest strategy and the tokens/s of every strategy."""
    out = []
    for network, rows in results:
        ok = sorted((r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")),
                    key=lambda r: -r["tokens_per_s"])
        ranking = ", ".join(f"{r['strategy']} {r['tokens_per_s']:.0f}" for r in ok) or "nothing ran"
        out.append(f"{network.label}: {ranking} tokens/s")
    return out


def _tokens_run(meta: dict, rows: list[dict]) -> int | None:
    """The tokens every run trained on: the steps x the global tokens per step (the same for all)."""
    per_step = next((r["tokens_per_step"] for r in rows if r.get("tokens_per_step")), None)
    return None if per_step is None else int(meta["steps"]) * int(per_step)


def write_all(sweep_dir: Path, meta: dict, results: list[tuple[Network, list[dict], dict[str, dict]]]) -> None:
    """results.csv, results.json, crossover.png and report.md across every network."""
    rows = [row for _, network_rows, _ in results for row in network_rows]
    write_json(sweep_dir / "results.json", meta, rows)
    write_csv(sweep_dir / "results.csv", rows)
    pairs = [(network, network_rows) for network, network_rows, _ in results]
    crossover_plot(pairs, sweep_dir / "crossover.png")
    rounds = meta.get("rounds", 1)
    parts = [
        "# Every strategy on every network\n",
        f"Command: `{meta['command']}`\n",
        f"Model `{meta['model']}` ({meta['parameters']} parameters), {meta['steps']} steps, global batch "
        f"{meta['global_batch']} sequences of {meta['seq_len']} tokens; peak {meta['peak_flops']:.3g} FLOP/s per "
        f"device ({meta['peak_source']}); torch {meta['torch']}; {meta['device']}"
        + (f"; {rounds} rounds per network (tokens/s: median, and min-max in brackets)" if rounds > 1 else "") + ".\n",
        "## Tokens/s per strategy and network (the fastest in bold)\n",
        tokens_table(pairs, _tokens_run(meta, rows)) + "\n",
        "![tokens/s against the inter-node bandwidth](crossover.png)\n",
        "## Per network: the best layout, and what the others wait on\n",
        "Time per step (ms, the median step's breakdown, mean over ranks), bytes per step crossing each class "
        "of link (the interface counters), and how long the busiest link of that class needs for them at its "
        "rate (the larger of what any node sent or received, x 8 / rate). Exposed communication at least half "
        "as long as a link's busy time is put down to that link.\n",
    ]
    for network, network_rows, summaries in results:
        parts += network_verdict(network, network_rows, summaries)
        parts.append(f"Full report: [{network.dir_name}/report.md]({network.dir_name}/report.md)\n")
    (sweep_dir / "report.md").write_text("\n".join(parts))
