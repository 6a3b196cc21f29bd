"""What one rank measured in a run, sent to rank 0 at the end for summary.json (report/summary.py)."""

from __future__ import annotations

import torch

from parallel.core.model import count_parameters
from parallel.report.metrics import peak_memory_bytes


def rank_report(run) -> dict:
    """What this rank measured: `run` is parallel/train.py's Run, after its last step."""
    strategy, ctx = run.strategy, run.ctx
    return {
        "rank": ctx.rank,
        "coords": ctx.coords,
        "pipeline_spans": getattr(strategy, "spans", None),
        "pipeline_executed": [str(a) for a in getattr(strategy, "executed", [])],
        "parameters": strategy.full_parameter_count(),
        "local_parameters": count_parameters(strategy.model),
        "step_times": run.step_times,
        "traffic": ctx.log.steps,
        "traffic_outside": dict(ctx.log.outside),  # set-up, the loopback probe, checkpoints: so far
        "peak_memory_bytes": peak_memory_bytes(ctx.device),
        "activation_peak_bytes": run.activation_peaks[-1] if run.activation_peaks else 0,  # the last step's
        "routing": run.routing,
        "net": run.wire.report() if run.wire is not None else None,
        "time_breakdown": run.breakdowns,
        "breakdown_note": strategy.breakdown_note,
        "exposed_comm_measured": strategy.exposed_comm_measured,
        "trace": run.trace,
        "events": {"rank": ctx.rank, "coords": ctx.coords, "node": run.wire.node if run.wire is not None else 0,
                   "machine": ctx.peers[ctx.rank][2] if ctx.peers else None, "cores": run.cores,
                   "threads": torch.get_num_threads(),  # its virtual device's cores (replay/device.py)
                   "groups": {name: list(c.global_ranks) for name, c in ctx.comms.items() if c is not None},
                   "steps": run.events},
        # Parameters, gradients and optimizer state this rank holds after the last step, and its
        # peak during that step, from tensor sizes.
        "model_state": strategy.memory_report(),
        "checkpoints": run.checkpoints,
    }
