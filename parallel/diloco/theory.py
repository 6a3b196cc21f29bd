"""DiLoCo's closed forms: the outer all-reduce's bytes, per sync and per step, and its extra state.

Independent of the code it checks: Ψ_f from the GPT formula (parallel/algebra.py's parts grouped as
schedule.py's fragments), bytes from the ring's factor, never from the model's tensors or the log.

Per sync of fragment f every rank sends 2(N-1)/N·Ψ_f·B (one ring all-reduce of its pseudo-gradient;
N = dp). Fragment f syncs once in every H steps, so over any H consecutive steps every rank sends
Σ_f 2(N-1)/N·Ψ_f·B = 2(N-1)/N·Ψ·B: dp's one step of traffic, spread over H steps. The figure per
step (`diloco_comm`, the summary's expected_comm) is that mean, exact over any H consecutive steps
(`period_steps` says H: parallel/report/summary.py compares it with the last H steps' mean). The
bytes of each sync, the peak a link carries at once, are `fragment_sync_bytes`: Ψ_f of Ψ, about 1/F.
"""

from __future__ import annotations

from fractions import Fraction

from parallel.algebra import all_reduce_sent_per_rank, figure, part_parameter_counts
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.diloco.options import DiLoCoOptions
from parallel.diloco.schedule import fragment_parts
from parallel.layout import Layout
from parallel.model_state import model_state, run_state_bytes, whole_model_parts


def fragment_parameters(model: GPTConfig, fragments: int) -> list[int]:
    """Ψ_f: the parameters of each fragment (its parts' counts summed)."""
    counts = part_parameter_counts(model)
    return [sum(counts[i] for i in run) for run in fragment_parts(len(counts), fragments)]


def fragment_sync_bytes(model: GPTConfig, layout: Layout) -> list[tuple[int, Fraction]]:
    """(payload, sent) of one sync of each fragment, summed over all ranks: Ψ_f·B per rank in,
    2(N-1)/N·Ψ_f·B per rank out."""
    dims, options = layout.dims, layout.of(DiLoCoOptions)
    world = dims.world_size
    return [(psi * layout.dtype_bytes * world, all_reduce_sent_per_rank(dims.dp, psi * layout.dtype_bytes) * world)
            for psi in fragment_parameters(model, options.fragments)]


def diloco_comm(model: GPTConfig, layout: Layout) -> dict:
    """The mean traffic per step, all ranks: every fragment's sync once per H steps, 2(N-1)/N·Ψ·B/H per rank."""
    options = layout.of(DiLoCoOptions)
    syncs = fragment_sync_bytes(model, layout)
    h = options.inner_steps
    payload = sum(p for p, _ in syncs)
    sent = sum((s for _, s in syncs), Fraction(0))
    per_sync = [{"payload_bytes": p, "sent_bytes": float(s), "sent_bytes_exact": str(s)} for p, s in syncs]
    return figure({"all_reduce": (payload / h, sent / h)}, layout.dims.world_size,
                  extra={"period_steps": h, "sent_bytes_per_fragment_sync": per_sync})


def outer_state_bytes_per_parameter(layout: Layout) -> int:
    """What DiLoCo adds per parameter: the outer copy, and the Nesterov buffer where μ > 0."""
    b = layout.dtype_bytes
    return b + (b if layout.of(DiLoCoOptions).outer_momentum > 0 else 0)


def diloco_model_state_bytes(model: GPTConfig, layout: Layout) -> dict:
    """Every part whole, as plain dp (the inner AdamW's 2B per parameter), plus the outer state
    counted with the optimizer's: B for the outer copy and B for the momentum where μ > 0."""
    p, g, o = run_state_bytes(layout.dtype_bytes)
    return model_state(whole_model_parts(ModelShape(gpt=model)), (p, g, o + outer_state_bytes_per_parameter(layout)))
