"""What a strategy pays for its speed on slow links: the bytes it puts on each class of link, and the
loss it reaches after the sweep's tokens (the crossover table's last columns, its plot's right panel).

The remedies for slow links (docs/interconnect-remedies.md) trade one for the other: hybrid
sharding keeps ZeRO's gathers inside a node (fewer inter-node bytes, the same loss), low-precision
collectives send fewer bytes per value (a rounding error in each gradient), DiLoCo syncs once per H
steps (1/H of the bytes; workers that drift apart in between). A strategy's bytes per step depend on
the layout, not the link's rate, so they are given once per family of networks (the same nodes,
ranks and placement; parallel/compare/crossover.py's `_family`), from the interface counters
(`inter_`/`intra_wire_bytes_per_step`: every node's sent bytes, per timed step). Every run of a
sweep trains on the same tokens (train.steps x the global batch), so the final loss of each is the
loss after that many tokens: the mean over ranks of the last step's training loss (for DiLoCo, the
workers' own models, H steps apart from the last sync at most).
"""

from __future__ import annotations

from parallel.compare.rows import MB

LOSS_SPREAD = 1e-5  # the project's "the same losses" (relative): one figure where the networks agree


def _ok(rows: list[dict], strategy: str) -> dict | None:
    return next((r for r in rows if r["strategy"] == strategy and r["status"] == "ok"), None)


def byte_families(results, family_of, family_name) -> list[tuple[str, list]]:
    """(name, its networks' rows) per family of emulated networks whose rows carry link counters."""
    families: dict = {}
    for network, rows in results:
        if network.emulated and any(r.get("inter_wire_bytes_per_step") is not None for r in rows):
            families.setdefault(family_of(network), (family_name(network), []))[1].append(rows)
    return list(families.values())


def bytes_cell(family_rows: list[list[dict]], strategy: str) -> str:
    """`inter / intra` MB per step (the counters) on the first network of the family where it ran."""
    row = next((r for rows in family_rows if (r := _ok(rows, strategy)) is not None), None)
    if row is None or row.get("inter_wire_bytes_per_step") is None:
        return "-"
    intra = row.get("intra_wire_bytes_per_step") if (row.get("procs_per_node") or 1) > 1 else None
    return f"{row['inter_wire_bytes_per_step'] / MB:.3g} / " + ("-" if intra is None else f"{intra / MB:.3g}")


def loss_cell(results, strategy: str) -> str:
    """The final loss; a range where the networks' runs of the strategy differ by more than LOSS_SPREAD."""
    losses = sorted(r["final_loss"] for _, rows in results if (r := _ok(rows, strategy)) and r.get("final_loss"))
    if not losses:
        return "-"
    if losses[-1] - losses[0] <= LOSS_SPREAD * abs(losses[0]):
        return f"{losses[0]:.4f}"
    return f"{losses[0]:.4f}-{losses[-1]:.4f}"


def extra_columns(results, family_of, family_name, tokens: int | None) -> tuple[list[str], dict[str, list[str]]]:
    """The table's extra headers, and per strategy its cells: bytes per family, then the loss."""
    strategies = list(dict.fromkeys(r["strategy"] for _, rows in results for r in rows))
    families = byte_families(results, family_of, family_name)
    heads = [f"MB/step inter / intra ({name})" for name, _ in families]
    cells = {s: [bytes_cell(rows, s) for _, rows in families] for s in strategies}
    if any(r.get("final_loss") is not None for _, rows in results for r in rows):
        heads.append(f"loss after {tokens:,} tokens" if tokens else "final loss")
        for s in strategies:
            cells[s].append(loss_cell(results, s))
    return heads, cells


def loss_panel(ax, colors, results, family_of, family_name, strategies: list[str]) -> bool:
    """The right panel: each strategy's loss against its inter-node bytes per step (log scale), on the
    family of networks with counters where the most strategies ran. False where none has them."""
    from matplotlib import ticker

    families = byte_families(results, family_of, family_name)
    if not families:
        return False
    name, family_rows = max(families, key=lambda f: sum(bytes_cell(f[1], s) != "-" for s in strategies))
    for s, strategy in enumerate(strategies):
        row = next((r for rows in family_rows if (r := _ok(rows, strategy)) is not None), None)
        if row is None or not row.get("inter_wire_bytes_per_step") or row.get("final_loss") is None:
            continue
        x, y = row["inter_wire_bytes_per_step"] / MB, row["final_loss"]
        ax.scatter([x], [y], color=colors(s % 10), s=28, zorder=3)
        ax.annotate(strategy, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())  # 1, 2 and 5 of each decade: the others collide
    ax.set_xlabel(f"inter-node MB/step, link counters ({name.split(',')[0]}; log)")
    ax.set_ylabel("final loss (same tokens for every run)")
    ax.set_title("What it costs: bytes and loss")
    return True
