"""Expert parallelism beside tensor and pipeline parallelism, as Megatron-Core runs a mixture of experts:
the planner's formulas on a layout the sandbox cannot run.

The sandbox runs `ep` inside data parallelism only (parallel/moe/rules.py), so published MoE runs (tp x
pp x ep, the experts carved out of dp as Megatron-Core does) cannot go through run_plan.py. This module
evaluates such a layout with the same formulas the planner's rows use, composed here:

  layout      the dense counterpart's (the same shape without experts) 3-D plan from run_plan.py (its
              schedule, virtual stages, ZeRO stage, microbatches), with ep carved out of its dp ranks
  bytes       tp and pp: the dense counterpart's closed forms (parallel/compose/theory.py; the experts cut
              over tp as the dense MLP is: Megatron-Core's expert tensor parallelism of that era);
              dp: every rank's non-expert parameters (the routers included) over dp, its experts over
              edp (dp/ep), as ring all-reduces (ZeRO-1's reduce-scatter and all-gather send the same);
              ep: the uniform-routing all-to-alls of its stage's MoE blocks (parallel/moe/theory.py),
              each rank dispatching its b·s/t tokens (sequence parallelism's piece); with expert tp 1
              the ep and edp groups are placed as Megatron-Core's parallel folding places them (`folded`)
  time        timing.py's step (moe.py's router and expert GEMMs) on those bytes and links
  memory      memory.py's activations (with moe.py's per-token MoE term) and model state with the
              experts' optimizer state sharded over edp, not dp (Megatron's distributed optimizer)

What it leaves out: the token permutation's all-gathers inside a tp group (expert tensor parallelism
exchanges the dispatched rows between the t ranks), and every overlap Megatron-Core adds beyond
timing.py's (its dp reductions and parameter gathers overlap with compute; ZeRO-1's are exposed here).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from parallel.algebra import all_reduce_sent_per_rank
from parallel.compose.theory import chunks_per_rank
from parallel.core.shape import ModelShape
from parallel.dist.dims import ParallelDims
from parallel.layout import Layout
from parallel.model_state import STATE_BYTES, model_state
from parallel.moe.theory import uniform_sent_per_rank
from parallel.planner import memory
from parallel.planner.cluster import Cluster
from parallel.planner.enumerate import zero_stage
from parallel.planner.links import group_span
from parallel.planner.timing import step_time
from parallel.planner.traffic import GroupTraffic, group_totals

WIDTH = 2  # bf16 activations and gradients


def dense_counterpart(shape: ModelShape) -> ModelShape:
    """The same shape with one MLP per block and no router: what run_plan.py plans a 3-D layout for."""
    return ModelShape(gpt=replace(shape.gpt, moe_experts=0))


def with_experts(layout: Layout, ep: int) -> Layout:
    """The dense layout with ep carved out of its dp ranks (ep consecutive dp ranks: parallel/dist/dims.py)."""
    d = layout.dims
    return replace(layout, dims=ParallelDims.resolve(d.world_size, d.dp, d.tp, d.pp, d.cp, ep))


def expert_replicas(dims: ParallelDims, expert_tp: int) -> int:
    """edp: the ranks of one stage that hold the same expert shard, tp·dp / (ep·expert_tp) (Megatron-Core's
    parallel folding: the experts' ep x expert_tp x edp ranks are a stage's tp x dp ranks)."""
    return dims.tp * dims.dp // (dims.ep * expert_tp)


def folded(dims: ParallelDims, expert_tp: int) -> ParallelDims:
    """Where the experts' groups sit: with expert_tp = 1, Megatron-Core's parallel folding orders a stage's
    tp x dp ranks as the experts' ep x edp ranks (ep consecutive ranks: `ep` of the stage's rank order), so
    tp folds into dp; with expert_tp = tp, ep consecutive dp ranks (parallel/dist/dims.py)."""
    if expert_tp == dims.tp:
        return dims
    return ParallelDims.resolve(dims.world_size, dims.dp * dims.tp, 1, dims.pp, dims.cp, dims.ep)


def stage_split(shape: ModelShape, layout: Layout, pp_rank: int, expert_tp: int) -> tuple[int, int]:
    """(non-expert, expert) parameters one rank of stage `pp_rank` holds: its dense counterpart's parts (cut
    over tp) less one MLP per block plus the block's router, and E/ep experts per MoE block cut over
    `expert_tp`."""
    g, dims = shape.gpt, layout.dims
    parts = memory.stage_parts(dense_counterpart(shape), layout, pp_rank)
    blocks = memory.rank_layers(shape, layout)[pp_rank]
    moe_blocks = blocks * len(g.moe_blocks) // g.n_layers
    mlp = shape.mlp_parameters()
    return (sum(parts) - moe_blocks * (mlp // dims.tp - g.d_model * g.moe_experts),
            moe_blocks * g.moe_experts // dims.ep * mlp // expert_tp)


def traffic(shape: ModelShape, dense_plan, layout: Layout, cluster: Cluster, expert_tp: int) -> dict[str, GroupTraffic]:
    """Every group's bytes per step (all ranks) on this layout (module docstring)."""
    g, dims = shape.gpt, layout.dims
    totals = {k: v for k, v in group_totals(dense_plan.spec.comm(dense_counterpart(shape).gpt, dense_plan.layout),
                                            dense_plan.layout).items() if k in ("tp", "pp")}
    per_stage = dims.world_size // dims.pp
    dp = edp = Fraction(0)
    for r in range(dims.pp):
        dense, experts = stage_split(shape, layout, r, expert_tp)
        dp += all_reduce_sent_per_rank(dims.dp, dense * WIDTH) * per_stage
        edp += all_reduce_sent_per_rank(expert_replicas(dims, expert_tp), experts * WIDTH) * per_stage
    tokens = layout.microbatch_size * g.seq_len // dims.tp
    blocks = Fraction(len(g.moe_blocks), dims.pp)  # each rank's stage holds its share of the MoE blocks
    ep = uniform_sent_per_rank(tokens, g.moe_top_k, g.d_model, g.moe_experts, dims.ep, WIDTH, blocks,
                               layout.microbatches) * dims.world_size
    totals.update({"dp": dp, "edp": edp, "ep": ep})
    experts_mesh = folded(dims, expert_tp)
    out = {}
    for name, total in totals.items():
        if total:
            span = group_span(experts_mesh if name in ("ep", "edp") else dims, name, cluster.gpus_per_node,
                              cluster.algorithm, chunks_per_rank(layout) if name == "pp" else 1)
            out[name] = GroupTraffic(name, total, total / 2 if name in ("dp", "edp") else Fraction(0), span,
                                     direct=total if name == "ep" else Fraction(0))
    return out


def stage_memory(shape: ModelShape, layout: Layout, zero: int, pp_rank: int, activations: list[int],
                 expert_tp: int) -> dict:
    """One rank of stage `pp_rank`: its non-expert state sharded over dp, its experts' over edp (ZeRO `zero`)."""
    dims = layout.dims
    dense, experts = stage_split(shape, layout, pp_rank, expert_tp)
    parts = [model_state([dense], STATE_BYTES["bf16"], zero, dims.dp),
             model_state([experts], STATE_BYTES["bf16"], zero, expert_replicas(dims, expert_tp))]
    state = {k: sum(p[f"{k}_bytes"] for p in parts) for k in ("param", "grad", "optimizer")}
    acts = activations[dims.rank_of(pp_rank, 0, 0)]
    buffers = memory.buffer_bytes(dense_counterpart(shape), layout, zero, "bf16", pp_rank)
    return {**state, "activations": acts, "buffers": buffers, "total": sum(state.values()) + acts + buffers}


def evaluate_moe_layout(shape: ModelShape, dense_plan, ep: int, cluster: Cluster, expert_tp: int | None = None) -> dict:
    """Step time, TFLOP/s per GPU and the fullest stage's memory of `dense_plan`'s layout with ep carved out of
    dp, for `shape` (a mixture of experts), in bf16 on `cluster`; the experts cut over `expert_tp` ranks (tp by
    default; its time is priced as tp's: the same FLOPs, the GEMMs' shapes differ)."""
    expert_tp = dense_plan.layout.dims.tp if expert_tp is None else expert_tp
    layout = replace(with_experts(dense_plan.layout, ep), dtype_bytes=WIDTH)
    zero = zero_stage(dense_plan.strategy, dense_plan)
    groups = traffic(shape, dense_plan, layout, cluster, expert_tp)
    layers = memory.rank_layers(shape, layout)
    time = step_time(shape, layout, zero, "bucketed", cluster, groups, layers, WIDTH)
    activations = memory.implementation_activation_bytes(shape, layout, WIDTH, cluster.flash_attention)
    stages = [stage_memory(shape, layout, zero, r, activations, expert_tp) for r in range(layout.dims.pp)]
    tokens = dense_plan.global_batch * shape.gpt.seq_len
    return {"step_s": time.total, "compute_s": time.compute, "exposed_comm_s": time.exposed_comm,
            "bubble_s": time.bubble, "comm_s_by_group": time.comm_by_group,
            "tflops_per_gpu": shape.flops_per_token() * tokens / time.total / layout.dims.world_size / 1e12,
            "memory": max(stages, key=lambda m: m["total"]), "fits": max(m["total"] for m in stages)
            <= cluster.usable_bytes}
