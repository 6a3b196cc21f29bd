"""The summary's `moe` block and routing.png: how the router spread the tokens, step by step, and
under expert parallelism what that cost in all-to-all bytes, measured against theory every step.

From every rank's `RoutingMeter` record (parallel/moe/stats.py), summed over ranks and microbatches:

  experts, top_k, capacity_per_sequence, moe_blocks      the layer's settings (C = ceil(c·s·k/E));
  capacity_per_step                                      min(C, s)·sequences: one expert's most per block
  tokens_per_expert_by_step  [step][block] -> E kept assignments (what the experts computed)
  routed_per_expert_by_step  [step][block] -> E assignments before dropping (what the router asked)
  dropped_by_step            assignments dropped past capacity, all blocks (a token with k = 2 can
                             lose one of its two); dropped_fraction_by_step of all T·k·L_moe
  skew_by_step               max over blocks of (busiest expert's kept assignments / the mean): 1 is
                             perfectly even, E is everything on one expert; routed_skew_by_step before
                             dropping (the router's own imbalance, which capacity then caps)
  tokens_per_expert_by_rank  the last step, per rank: [block] -> E kept assignments of its tokens
  expert_rank_rows           expert parallelism: rows each rank's experts computed in the last step
                             (R_r, all blocks and microbatches) and their skew: the slowest rank's load
  all_to_all                 expert parallelism: per step, the all-to-all bytes the log measured (all
                             ranks), the exact figure from that step's routing counts, and whether
                             they are equal; the uniform-routing figure beside them
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from parallel.core.routing import expert_capacity
from parallel.layout import Layout
from parallel.moe.theory import ep_all_to_all_exact, ep_all_to_all_uniform_bytes, rank_rows

PLOT = "routing.png"


def _by_rank(rank_reports: list[dict]) -> list[list[list[dict]]]:
    """Every rank's steps of calls, in global rank order."""
    return [r["routing"] for r in sorted(rank_reports, key=lambda r: r["rank"])]


def measured_routing(rank_reports: list[dict], step: int = -1) -> tuple | None:
    """Layout.routing of one step: routing[rank][call] = kept assignments per expert; None for a
    dense model (no rank reported an MoE call)."""
    ranks = _by_rank(rank_reports)
    if not any(steps and steps[step] for steps in ranks):
        return None
    return tuple(tuple(tuple(call["kept"]) for call in steps[step]) for steps in ranks)


def with_measured_routing(layout: Layout, rank_reports: list[dict]) -> Layout:
    """The layout of the run's last step with the routing it measured (unchanged for a dense model):
    what the registry's theory takes to give expert parallelism's exact bytes."""
    routing = measured_routing(rank_reports)
    return layout if routing is None else replace(layout, routing=routing)


def _sum_calls(calls_by_rank: list[list[dict]], key: str, blocks: list[str], experts: int) -> dict[str, list[int]]:
    """Counts per block summed over every rank's calls (its microbatches) of one step."""
    total = {b: [0] * experts for b in blocks}
    for calls in calls_by_rank:
        for call in calls:
            total[call["block"]] = [a + b for a, b in zip(total[call["block"]], call[key])]
    return total


def skew(counts: list[int]) -> float:
    """max / mean of the counts (1: even); 0 when nothing was counted."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


def _all_to_all_block(plan, layout: Layout, rank_reports: list[dict], n_steps: int) -> dict:
    """Measured (the log's ep group) against exact (theory on that step's routing), every step."""
    exact, measured = [], []
    for i in range(n_steps):
        step_layout = replace(layout, routing=measured_routing(rank_reports, i))
        exact.append(ep_all_to_all_exact(plan.model, step_layout)[1])
        measured.append(sum((t.sent_bytes for r in rank_reports for (op, group, _tag), t in r["traffic"][i].items()
                             if op == "all_to_all" and group == "ep"), Fraction(0)))
    uniform = ep_all_to_all_uniform_bytes(plan.model, layout) * plan.dims.world_size
    return {
        "measured_bytes_by_step": [float(b) for b in measured],
        "exact_bytes_by_step": [float(b) for b in exact],
        "exact_bytes_by_step_exact": [str(b) for b in exact],
        "matches_exact_every_step": measured == exact,
        "uniform_bytes_per_step": float(uniform),
        "uniform_bytes_per_step_exact": str(uniform),
        "exact_over_uniform_last_step": float(exact[-1] / uniform) if uniform else None,
    }


def routing_block(plan, rank_reports: list[dict], run_dir: Path | None) -> dict:
    """The summary's `moe` block (see the module docstring); writes routing.png into run_dir."""
    model = plan.model
    experts, ranks = model.moe_experts, _by_rank(rank_reports)
    blocks = [f"blocks.{i}.mlp" for i in model.moe_blocks]
    n_steps = len(ranks[0])
    kept = [_sum_calls([steps[i] for steps in ranks], "kept", blocks, experts) for i in range(n_steps)]
    routed = [_sum_calls([steps[i] for steps in ranks], "routed", blocks, experts) for i in range(n_steps)]
    dropped = [sum(map(sum, r.values())) - sum(map(sum, k.values())) for r, k in zip(routed, kept)]
    assignments = plan.tokens_per_step * model.moe_top_k * len(blocks)
    block = {
        "experts": experts, "top_k": model.moe_top_k, "capacity_factor": model.moe_capacity_factor,
        "capacity_per_sequence": expert_capacity(model.seq_len, model.moe_top_k, experts, model.moe_capacity_factor),
        # The most one expert can keep in one block and step: min(C, s) from each sequence.
        "capacity_per_step": min(expert_capacity(model.seq_len, model.moe_top_k, experts, model.moe_capacity_factor),
                                 model.seq_len) * plan.global_batch,
        "moe_blocks": blocks, "first_step": plan.start_step,
        "tokens_per_expert_by_step": [[k[b] for b in blocks] for k in kept],
        "routed_per_expert_by_step": [[r[b] for b in blocks] for r in routed],
        "dropped_by_step": dropped,
        "dropped_fraction_by_step": [d / assignments for d in dropped],
        "skew_by_step": [max(skew(k[b]) for b in blocks) for k in kept],
        "routed_skew_by_step": [max(skew(r[b]) for b in blocks) for r in routed],
        "tokens_per_expert_by_rank": [[_sum_calls([steps[-1]], "kept", blocks, experts)[b] for b in blocks]
                                      for steps in ranks],
        "expert_rank_rows": None,
        "all_to_all": None,
        "plot": None,
    }
    if plan.dims.ep > 1:
        block["expert_rank_rows"] = _expert_rank_rows(plan, ranks)
        block["all_to_all"] = _all_to_all_block(plan, with_measured_routing(plan.layout, rank_reports), rank_reports,
                                                n_steps)
    if run_dir is not None:
        plot_routing(block, run_dir / PLOT)
        block["plot"] = PLOT
    return block


def _expert_rank_rows(plan, ranks: list[list[list[dict]]]) -> dict:
    """Rows each rank's experts computed in the last step (R_r of parallel/moe/theory.py, summed over
    its MoE calls), and the busiest rank's over the mean."""
    rows = [0] * plan.dims.world_size
    for group in plan.dims.group_ranks("ep"):
        for call in range(len(ranks[group[0]][-1])):
            counts = [ranks[r][-1][call]["kept"] for r in group]
            for r, figures in zip(group, rank_rows(counts)):
                rows[r] += figures["received"]
    return {"rows_by_rank": rows, "skew": skew(rows)}


def plot_routing(block: dict, path: Path) -> None:
    """One panel per MoE block: kept assignments per expert at every step (lines), the capacity of
    the step's sequences together as a dashed line, and the assignments dropped (grey bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks, first = block["moe_blocks"], block["first_step"]
    steps = list(range(first, first + len(block["tokens_per_expert_by_step"])))
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.2 * len(blocks), 3.4), sharey=True, squeeze=False)
    for j, (ax, name) in enumerate(zip(axes[0], blocks)):
        kept = [step[j] for step in block["tokens_per_expert_by_step"]]
        routed = [step[j] for step in block["routed_per_expert_by_step"]]
        ax.bar(steps, [sum(r) - sum(k) for r, k in zip(routed, kept)], color="#BBBBBB", label="dropped")
        for e in range(block["experts"]):
            ax.plot(steps, [k[e] for k in kept], marker="o", markersize=3, label=f"expert {e}")
        ax.axhline(block["capacity_per_step"], linestyle="--", color="black", linewidth=1, label="capacity")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_xticks(steps)
    axes[0][0].set_ylabel("assignments kept (all ranks)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"tokens per expert per step: top-{block['top_k']} of {block['experts']}, capacity "
                 f"{block['capacity_per_sequence']} per sequence; last step's skew {block['skew_by_step'][-1]:.2f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
