"""What a run prints: one line per step, and the summary in a few lines (rank 0's console and log)."""

from __future__ import annotations

import logging

log = logging.getLogger("parallel")


def step_line(step: int, loss: float, seconds: float, sent_bytes: float, tokens_per_s: float | None) -> str:
    """One step on the console; `tokens_per_s` None for a warm-up step (not timed)."""
    timing = "warm-up" if tokens_per_s is None else f"{tokens_per_s:9.0f} tok/s"
    return (
        f"step {step:4d} | loss {loss:.4f} | {seconds * 1e3:8.1f} ms | {timing} | "
        f"{sent_bytes / 1e6:8.3f} MB sent by rank 0"
    )


def log_summary(summary: dict) -> None:
    """The run in a few lines: speed, MFU, memory, the families' own figures, where the time went,
    and the traffic against its closed form."""
    speed_lines(summary)
    family_lines(summary)
    breakdown_line(summary)
    traffic_lines(summary)


def speed_lines(summary: dict) -> None:
    log.info(
        "done: %d steps | final loss %.4f | median step %.1f ms | %.0f tokens/s | peak memory %.1f MB",
        summary["steps"], summary["losses"][-1], summary["step_time_s"] * 1e3, summary["tokens_per_s"],
        summary["peak_memory_bytes"] / 1e6,
    )
    virtual = summary.get("virtual")
    if virtual and "step_time_s" in virtual:
        device = virtual.get("device_per_rank")
        device = (device["in_words"] if isinstance(device, dict) else "its cores differ by rank" if device
                  else "not recorded")
        log.info("virtual (a device per rank: %s; %s): step %.1f ms | %.0f tokens/s | MFU %.1f%% | "
                 "wall: step %.1f ms | %.0f tokens/s | waits on %s", device, virtual["link_model"]["name"],
                 virtual["step_time_s"] * 1e3, virtual["tokens_per_s"], 100 * (virtual["mfu"]["mfu"] or 0),
                 summary["step_time_s"] * 1e3, summary["tokens_per_s"], virtual["waits_on"])
    elif virtual and "skipped" in virtual:
        log.info("virtual: %s", virtual["skipped"])
    log.info("MFU %.1f%% (%.3g FLOP/token, peak %.3g FLOP/s x %d device(s))", 100 * summary["mfu"]["mfu"],
             summary["mfu"]["flops_per_token"], summary["mfu"]["peak_flops"], summary["mfu"]["devices"])
    memory = summary["memory"]
    log.info("model state per rank (params + grads + optimizer, bytes): measured %s | formula %s",
             [r["total_bytes"] for r in memory["by_rank"]],
             memory["formula"]["total_bytes"] if memory["formula"] else "none for this layout")


def family_lines(summary: dict) -> None:
    """The pipeline's bubble against its closed form; the experts' routing and all-to-all."""
    if "pipeline" in summary:
        pipe = summary["pipeline"]
        closed = pipe["bubble_closed_form"]  # None where the schedule claims no closed form (ZB-V below m = 2p-1)
        log.info("pipeline %s: bubble measured %.1f%% | simulated %.1f%% | closed form %s (measured: every moment "
                 "a stage did not compute, p2p and waiting for a core included; simulated: the schedule alone)",
                 pipe["schedule"], 100 * pipe["bubble_measured"], 100 * pipe["bubble_simulated"],
                 "none" if closed is None else f"{100 * closed:.1f}%")
    if "moe" in summary:
        moe = summary["moe"]
        log.info("routing (last step): skew %.2f (busiest expert / mean), %d of %d assignments dropped | %s",
                 moe["skew_by_step"][-1], moe["dropped_by_step"][-1],
                 summary["tokens_per_step"] * moe["top_k"] * len(moe["moe_blocks"]), moe["plot"])
        if moe["all_to_all"]:
            a2a = moe["all_to_all"]
            verdict = "= the routing's exact figure every step" if a2a["matches_exact_every_step"] else "MISMATCH"
            log.info("all-to-all per step (all ranks): %.3f MB %s | uniform routing %.3f MB",
                     a2a["measured_bytes_by_step"][-1] / 1e6, verdict, a2a["uniform_bytes_per_step"] / 1e6)


def traffic_lines(summary: dict) -> None:
    """The step's bytes against theory, by op and by group, and tp's collectives per layer."""
    comm, expected = summary["comm"], summary["expected_comm"]
    exposed = (f"exposed comm {comm['exposed_seconds_per_step'] * 1e3:.1f} ms/step"
               if summary.get("exposed_comm_measured", True) else "exposed comm not measured (the waits are PyTorch's)")
    log.info(
        "traffic per step (all ranks): %.3f MB sent, theory %.3f MB (%s) | %s",
        comm["sent_bytes_per_step"] / 1e6, expected["sent_bytes_per_step"] / 1e6,
        "exact match" if summary["comm_matches_theory"] else
        "MISMATCH" if summary["precision"] == "fp32" else "differs: the closed form counts fp32 activations",
        exposed,
    )
    for op, t in comm["by_op"].items():
        log.info("  %-16s %4d calls  %10.3f MB payload  %10.3f MB sent", op, t["calls"], t["payload_bytes"] / 1e6,
                 t["sent_bytes"] / 1e6)
    for group, t in comm["by_group"].items():
        log.info("  group %-10s %4d calls  %10.3f MB sent", group, t["calls"], t["sent_bytes"] / 1e6)
    if any(tag.startswith("tp/") for tag in comm["by_tag_op"]):
        # The Megatron count: collectives per layer and direction, per rank and optimizer step.
        world = summary["world_size"]
        # In a pipeline each part's collectives run only on the ranks of the stage holding it
        # (world / pp of them); the sequence-sharded gradients' sum runs on every rank.
        holders = world // summary["parallel"]["pp"]
        log.info("tensor-parallel collectives per rank (of the stage holding the part) per step (%d microbatch(es)):",
                 summary["parallel"]["microbatches"])
        for tag, ops in comm["by_tag_op"].items():
            if tag.startswith("tp/"):
                ranks = world if tag == "tp/sp_grads" else holders
                log.info("  %-24s %s", tag, ", ".join(f"{t['calls'] // ranks} {op}" for op, t in ops.items()))


def breakdown_line(summary: dict) -> None:
    """Where the median step's time went (parallel/report/breakdown.py), and the trace files."""
    parts = summary.get("time_breakdown_s")
    if parts:
        detail = summary["time_breakdown"]
        step = detail["step_time_s"]
        shares = " | ".join(f"{name.replace('_', ' ')} {seconds * 1e3:.1f} ms ({seconds / step:.0%})"
                            for name, seconds in parts.items())
        log.info("step %d (median, %.1f ms): %s", detail["step"], step * 1e3, shares)
        for note in detail["notes"]:
            log.info("  note: %s", note)
    trace = summary.get("trace")
    if trace:
        log.info("last step's timeline of every rank: %s%s (open trace.json in https://ui.perfetto.dev)",
                 trace["trace"], f", {trace['timeline']}" if trace["timeline"] else "")
