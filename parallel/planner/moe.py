"""A mixture of experts in the planner: what its MoE blocks save for backward, and what they compute.

A block whose MLP is a mixture (parallel/core/model.py's MoEMLP) replaces the dense MLP's hidden
activations with the router's, the experts' and the combine's. Per MoE block and microbatch of
n = b·s tokens on one rank, with A the rank's kept assignments (rows it dispatches) and R the rows
its experts compute (A without expert parallelism; under it, what the ep group sends this rank's
experts: parallel/moe/theory.py's A_r and R_r), the sandbox saves (docs/theory/planner.md):

    router     its softmax's output n·E·4 (fp32 whatever the activations: the router runs in fp32),
               top-k's indices n·k·8, with k >= 2 the chosen probabilities n·k·4 and their sum n·4
               (the renormalisation), the balancing loss's f_e per sequence b·E·4, the keep mask n·k·1
    rows       the kept assignments' sort order and token indices 2·A·8, their gate weights A·4
    experts    their input rows R·h·B, their hidden activations (2 or, gated, 4)·R·f·B
    combine    the experts' outputs back on this rank A·h·B and the weighted rows A·h·B

The ln2 output the router and the experts read is the block's `mlp_input`, counted as for a dense
block. The implementation never pads to capacity, so A and R follow the routing: measured (a run's
`Layout.routing`), or for a layout never run uniform routing with nothing dropped, A = n·k and
R = n·k times `imbalance` (the busiest rank's rows over the mean: an assumption, 1.0 by default),
never more than the capacity allows (b·E·min(C, s) rows a rank's experts can receive).

Cluster shapes in bf16 (Megatron-Core's all-to-all dispatcher): per token, the router's logits and
probabilities in fp32 2·E·4 and its indices k·8, the permuted rows k·h·w, the experts' hidden
activations k·(3 or 2)·f·w/t, their outputs k·h·w and the gate weights k·4, every row count
times the imbalance where a rank's experts compute it.

Compute: the router's GEMM n x E x h, and each of the rank's E/ep experts' GEMMs on its rows
(R·ep/E each), in place of the dense MLP's; the permutation's copies at HBM speed. The all-to-alls
are theory's bytes (parallel/moe/theory.py) on the links the placement gives the ep group
(traffic.py, timing.py: blocking, half in forward and half in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel import activations
from parallel.algebra import FP32_BYTES, ID_BYTES
from parallel.core.routing import expert_capacity
from parallel.core.shape import ModelShape
from parallel.layout import Layout
from parallel.moe.theory import rank_rows
from parallel.planner.compute import Device, Gemm

MASK_BYTES = 1  # a bool per token and choice
IMBALANCE = 1.0  # the busiest rank's expert rows over the mean, where no run measured it: an assumption


@dataclass(frozen=True)
class MoECall:
    """One MoE block on one microbatch, on one rank: the rows it dispatches and the rows its experts compute."""

    dispatched: int  # A
    received: int  # R


def router_saved_bytes(shape: ModelShape, b: int) -> int:
    """What the router and the routing save for one microbatch of b sequences (A-independent part)."""
    g = shape.gpt
    n, E, k = b * g.seq_len, g.moe_experts, g.moe_top_k
    renormalised = n * k * FP32_BYTES + n * FP32_BYTES if k >= 2 else 0
    return n * E * FP32_BYTES + n * k * ID_BYTES + renormalised + b * E * FP32_BYTES + n * k * MASK_BYTES


def moe_mlp_saved_bytes(shape: ModelShape, b: int, call: MoECall, act_bytes: int) -> int:
    """One MoE block's MLP part for one microbatch (the sandbox, module docstring): router, rows, experts, combine."""
    g = shape.gpt
    h, f, A, R = g.d_model, shape.ffn, call.dispatched, call.received
    hidden = (4 if shape.gated_mlp else 2) * R * f * act_bytes
    rows = 2 * A * ID_BYTES + A * FP32_BYTES
    return router_saved_bytes(shape, b) + rows + R * h * act_bytes + hidden + 2 * A * h * act_bytes


def uniform_call(shape: ModelShape, b: int, ep: int, imbalance: float = IMBALANCE) -> MoECall:
    """A layout never run: every token's k assignments kept (A = n·k), the rank's experts computing
    n·k rows times `imbalance`, at most what the capacity lets them receive (b·E·min(C, s))."""
    g = shape.gpt
    n = b * g.seq_len
    cap = b * g.moe_experts * min(expert_capacity(g.seq_len, g.moe_top_k, g.moe_experts, g.moe_capacity_factor),
                                  g.seq_len)
    A = min(n * g.moe_top_k, cap)
    return MoECall(A, A if ep == 1 else min(int(A * imbalance), cap))


def measured_calls(layout: Layout) -> list[list[MoECall]]:
    """Per global rank, its MoE calls of the measured step (`Layout.routing`): A from its own kept counts,
    R from its ep group's (parallel/moe/theory.py's rank_rows; R = A without expert parallelism)."""
    dims, routing = layout.dims, layout.routing
    calls: list[list[MoECall]] = [[] for _ in range(dims.world_size)]
    for group in dims.group_ranks("ep"):
        for i in range(len(routing[group[0]])):
            rows = rank_rows([list(routing[r][i]) for r in group])
            for r, row in zip(group, rows):
                calls[r].append(MoECall(row["dispatched"], row["received"]))
    return calls


def sandbox_activation_bytes(shape: ModelShape, layout: Layout, imbalance: float = IMBALANCE) -> list[int] | None:
    """Saved bytes at the step's peak on every rank, for the sandbox's MoE runs in fp32 (one stage, no tp,
    cp or recomputation): the dense stage's formula (parallel/activations.py) with each MoE block's MLP
    term replaced by `moe_mlp_saved_bytes`, at the end of the forward of the microbatch that saves most
    (one microbatch's graph is held at a time). None outside those layouts."""
    g, dims = shape.gpt, layout.dims
    if dims.tp > 1 or dims.pp > 1 or dims.cp > 1 or g.dropout or layout.precision != "fp32" \
            or (layout.recompute or "none") != "none":
        return None
    global_batch = dims.dp * layout.microbatches * layout.microbatch_size
    dense = activations.stage_terms(shape, layout, global_batch)["peak"]
    b, blocks = layout.microbatch_size, len(g.moe_blocks)
    mlp = activations.block_terms(shape, layout.cut(FP32_BYTES))["mlp"]
    if layout.routing is None:
        calls = [[uniform_call(shape, b, dims.ep, imbalance)] * (blocks * layout.microbatches)] * dims.world_size
    else:
        calls = measured_calls(layout)
    peaks = []
    for mine in calls:
        per_microbatch = [sum(moe_mlp_saved_bytes(shape, b, c, FP32_BYTES) for c in mine[i:i + blocks])
                          for i in range(0, len(mine), blocks)]
        peaks.append(dense - blocks * mlp + max(per_microbatch))
    return peaks


# -- cluster shapes (bf16, Megatron-Core style) -------------------------------------------------------------
def moe_units_delta(shape: ModelShape, t: int, act_bytes: int, imbalance: float = IMBALANCE) -> float:
    """Bytes per token an MoE block saves beyond a dense block's (memory.block_units), averaged over every
    block (L_moe of L are MoE): the router's fp32 logits and probabilities and indices, the permuted rows,
    the experts' hidden activations and outputs at k rows per token (x imbalance), less the dense MLP's."""
    g = shape.gpt
    if not g.moe_experts:
        return 0.0
    k, w, h, f = g.moe_top_k, act_bytes, g.d_model, shape.ffn
    hidden = (3 if shape.gated_mlp else 2) * f * w / t
    router = 2 * g.moe_experts * FP32_BYTES + k * ID_BYTES
    moe = router + k * imbalance * (h * w + hidden) + k * (h * w + FP32_BYTES)
    return (moe - hidden) * len(g.moe_blocks) / g.n_layers


# -- compute ----------------------------------------------------------------------------------------------
def moe_block_delta(shape: ModelShape, device: Device | None, rate: float, t: int, b: int, ep: int, width: int,
                    imbalance: float = IMBALANCE) -> dict[str, float]:
    """Forward seconds and FLOPs one MoE block adds to a dense block on one rank and microbatch: the
    router's GEMM, each of the E/ep local experts' two (three, gated) GEMMs on its R·ep/E rows in place of
    the dense MLP's on n rows, and the permutation's copies (read n·h and write R·h rows, and back), at
    HBM speed. Without a device (`rate`: FLOP/s) the FLOPs at that rate."""
    g = shape.gpt
    n, h, f, E = b * g.seq_len, g.d_model, shape.ffn, g.moe_experts
    rows = uniform_call(shape, b, ep, imbalance).received
    up = (2 if shape.gated_mlp else 1) * f // t
    per_expert = max(1, round(rows * ep / E))
    dense = [Gemm(n, up, h), Gemm(n, h, f // t)]
    experts = [Gemm(per_expert, up, h, E // ep), Gemm(per_expert, h, f // t, E // ep)]
    router = Gemm(n, E, h)
    flops = router.flops + sum(x.flops for x in experts) - sum(x.flops for x in dense)
    if device is None:
        return {"forward": flops / rate, "flops": flops}
    seconds = device.seconds(router, FP32_BYTES) + sum(device.seconds(x, width) for x in experts) \
        - sum(device.seconds(x, width) for x in dense)
    permute = 2 * (n + rows) * h * width / device.hbm_bytes_per_s
    return {"forward": seconds + permute, "flops": flops}


def with_moe_compute(shape: ModelShape, layout: Layout, device: Device | None, rate: float, layers: int,
                     width: int, stage: tuple, imbalance: float = IMBALANCE) -> tuple:
    """timing.py's (forward, backward, hardware FLOPs, model FLOPs) of the slowest stage, with its share of
    the MoE blocks (L_moe/L of its `layers`) priced by `moe_block_delta`: backward twice the forward."""
    g, dims = shape.gpt, layout.dims
    forward, backward, hardware, model = stage
    blocks = layers * len(g.moe_blocks) / g.n_layers
    delta = moe_block_delta(shape, device, rate, dims.tp, layout.microbatch_size, dims.ep, width, imbalance)
    replicas = dims.world_size // dims.pp * layout.microbatches  # as timing.py counts a step's FLOPs
    extra = 3 * delta["flops"] * len(g.moe_blocks) * replicas
    return (forward + blocks * delta["forward"], backward + 2 * blocks * delta["forward"],
            None if hardware is None else hardware + extra, None if model is None else model + extra)
