"""Step time: compute, exposed communication and the pipeline bubble, from FLOPs, bytes and links.

Every rule here is an assumption the report names (ASSUMPTIONS):

compute    Forward FLOPs per microbatch on one rank of stage r: b·s·(L_r·(2·P_layer + 4·s·h)/t
           + [last stage] 2·(V·h + norm)/t), P_layer a block's parameters (2 FLOPs per weight
           per token) and 4·s·h the attention matmuls Q·Kᵀ and softmax·V; backward twice the
           forward (input and weight gradients), plus the recomputed forward of every block (full)
           or of every attention core (selective). Summed over ranks this is the MFU count 6·N +
           12·L·h·s per token (parallel/report/mfu.py). Time = FLOPs / (peak x efficiency).
collective latency + bytes / bandwidth on the link class it crosses (Thakur et al. 2005; NCCL's
           bus-bandwidth convention: the bytes are theory's ring bytes per rank). Hierarchical
           (NCCL across nodes): the in-node part at the in-node rate, then the between-node part
           at the NIC's rate. Ring (gloo): a ring moves at its slowest edge, so a ring that spans
           nodes sends all its bytes at the between-node rate, shared by the transfers that leave
           a node at once where the node has one link. Latency per call: one per algorithm step
           (2(N-1) for an all-reduce, N-1 for a gather, a scatter or an all-to-all, 1 for a send; an
           all-to-all's blocks go straight to their members, so its share that crosses nodes is
           its members' peers off-node, at the between-node rate, whatever the algorithm), the call count
           being the bytes over one message (an activation of b·s·h for tp, cp and ep and the
           pipeline, a bucket for dp).
overlap    tp, cp and ep collectives block the forward or backward they sit in (half each); where the
           framework overlaps them (`tp_backward_overlap`), the column-parallel linears' backward
           collectives run beside their gradient GEMMs (`tp_hidden_in_backward`).
           The dp group's gradient reductions overlap the backward they follow: bucketed dp and
           ZeRO-1 after the last microbatch (ZeRO-1 reduces once the schedule ends: none), ZeRO-2
           and ZeRO-3 inside every microbatch's backward; the last bucket never overlaps, and the
           reductions of several such groups share that one window. ZeRO's parameter all-gathers
           are exposed. A sync that waits for the step's backward and reductions hides behind
           nothing (`GroupTraffic.after_step`): HSDP's all-reduce of the gradient shards over the
           replicate group, posted once the shard group's reduce-scatters are in, and DiLoCo's
           outer all-reduce, whose seconds are one sync's over H (`GroupTraffic.every`). Pipeline
           sends: beside compute on a GPU (NCCL streams), exposed only on the fill and drain path,
           2·(v·p-1) messages; on gloo they run on the sender's path, and the simulator plays them
           as such.
bubble     the slowest stage works m·(F + B) of its own (tp time included); the schedule's fill and
           drain run through the other stages, so the idle it adds is the schedule's (its closed form,
           else parallel/pp/simulator.py's lists, no send cost) played with the other stages' mean
           forward and backward: with the last stage slowest (it holds the head), 1F1B's makespan is
           m·(F_last + B_last) + (p-1)·(F + B) of the others, as the simulator plays stages that differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.compose.theory import chunks_per_rank, pipeline_makespan
from parallel.core.shape import ModelShape
from parallel.dist.dims import DATA_PARALLEL
from parallel.planner.cluster import Cluster
from parallel.planner.links import GroupSpan

ASSUMPTIONS = {
    "compute": "forward FLOPs per token and rank = (2·block params + 4·s·h)/t per layer (+ 2·(V·h + norm)/t on the "
               "last stage); backward = 2 x forward; time = FLOPs / (peak x efficiency)",
    "collectives": "latency x algorithm steps + theory's ring bytes per rank / bandwidth x comm_efficiency, on the "
                   "link class crossed; hierarchical across nodes on GPUs, a ring (slowest edge) on gloo",
    "overlap": "tp/cp/ep collectives block compute (where the cluster's tp_backward_overlap is set, the column-"
               "parallel linears' backward collectives run beside their gradient GEMMs); dp all-reduce (bucketed) "
               "and ZeRO-2/3 reduce-scatters (HSDP's shard group's too) overlap backward, less the last bucket; "
               "ZeRO-1's reduction, every ZeRO all-gather and HSDP's replicate all-reduce (after the reduce-scatters) "
               "are exposed; DiLoCo's outer all-reduce is exposed, once per H steps; "
               "pipeline sends overlap compute on GPUs (2·(v·p-1) exposed on fill and drain) and not on gloo",
    "bubble": "the slowest stage's m·(F + B) plus the schedule's idle (parallel/pp/simulator.py's lists) played "
              "with the other stages' mean forward and backward times (the fill and drain run through them)",
    "codec": "the lossy collectives' casts, block scales, quantization and error feedback, and DiLoCo's outer step "
             "(once per H steps): elements x bytes read and written per element over the code's own passes / the "
             "codec rate (GPU presets: HBM bandwidth; this machine: int8 pack and unpack of 4 MiB timed at start "
             "on every rank at once), on the critical path: added to compute, overlapped with nothing",
    "optimizer": "the optimizer step after the schedule: the elements the rank's optimizer updates (all of its "
                 "parameters, ZeRO's 1/n) x the bytes its update's passes read and write / the codec rate, the "
                 "largest stage's, added to compute",
    "copies": "ZeRO-2/3's and FSDP2's copies around their collectives (gradient buffers zeroed and filled, shards "
              "accumulated; FSDP2's copy-in, copy-out and chunk_cat): the rank's parameters x the bytes of the "
              "code's passes per microbatch and gather / the codec rate, added to compute",
    "not modeled": "kernel launch and Python overheads, stragglers, stage imbalance beyond the slowest stage, "
                   "network congestion",
}
BUCKET_BYTES = 25 * 2**20  # parallel.bucket_mb's default, PyTorch DDP's


@dataclass(frozen=True)
class StepTime:
    compute: float
    exposed_comm: float
    bubble: float
    comm_by_group: dict  # seconds per step each group's traffic takes (exposed or not)
    forward: float  # per microbatch, the slowest stage, compute only
    backward: float
    hardware_flops: float | None = None  # per step, all ranks: model FLOPs plus recomputation's (roofline only)
    model_flops: float | None = None
    compute_parts: dict | None = None  # seconds per step on the slowest rank: matmuls, attention, elementwise
    codec: float = 0.0  # of `compute`: the lossy collectives' casts and scales, DiLoCo's outer step (codec.py)
    optimizer: float = 0.0  # of `compute`: the optimizer step over the rank's parameters (optimizer_step.py)
    copies: float = 0.0  # of `compute`: ZeRO-2/3's and FSDP2's copies around their collectives (shard_copies.py)

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble


def forward_flops_per_token(shape: ModelShape, t: int, layers: int, last: bool) -> float:
    g = shape.gpt
    per_layer = 2 * shape.layer_parameters() + 4 * g.seq_len * g.d_model
    head = 2 * (g.padded_vocab_size * g.d_model + shape.norm_parameters) if last else 0
    return (layers * per_layer + head) / t


def collective_seconds(bytes_per_rank: float, span: GroupSpan, cluster: Cluster, message_bytes: float,
                       steps_per_call: int, point_to_point: bool = False) -> float:
    """One rank's time for a group's bytes per step on its links (see the module docstring). A
    point-to-point transfer's bytes go at the rate of the boundary they cross: the group's share of
    crossing boundaries at the between-node rate, the rest at the in-node rate."""
    if bytes_per_rank <= 0:
        return 0.0
    calls = max(1.0, bytes_per_rank / max(message_bytes, 1.0))
    eff = cluster.comm_efficiency
    if not span.spans_nodes:
        return calls * steps_per_call * cluster.intra_latency_s + bytes_per_rank / (cluster.intra_bytes_per_s * eff)
    inter_rate = cluster.inter_bytes_per_s / max(1.0, span.flows_per_node) if cluster.node_link_shared \
        else cluster.inter_bytes_per_s
    fraction = float(span.inter_fraction)
    if point_to_point or cluster.algorithm == "hierarchical":
        inter = bytes_per_rank * fraction
        crossing = fraction if point_to_point else (span.nodes - 1) / max(span.size - 1, 1)
        latency = steps_per_call * (cluster.intra_latency_s * (1 - crossing) + cluster.inter_latency_s * crossing)
        intra = bytes_per_rank - inter
        return calls * latency + intra / (cluster.intra_bytes_per_s * eff) + inter / (inter_rate * eff)
    # A ring over nodes moves at its slowest edge: every byte at the between-node rate.
    rate = min(inter_rate, cluster.intra_bytes_per_s) * eff
    return calls * steps_per_call * cluster.inter_latency_s + bytes_per_rank / rate


def step_time(shape: ModelShape, layout, zero: int, grad_sync: str | None, cluster: Cluster, traffic: dict,
              layers_by_rank: list[int], act_bytes: int, codec: float = 0.0, optimizer: float = 0.0,
              copies: float = 0.0) -> StepTime:
    """Compute, exposed communication and bubble of one optimizer step, on the slowest pipeline rank;
    `codec`: seconds of elementwise codec work on the rank's critical path (codec.py), and `optimizer`: its
    optimizer step (optimizer_step.py), and `copies`: a sharded strategy's copies around its collectives
    (shard_copies.py), all part of compute."""
    m, world = layout.microbatches, layout.dims.world_size
    forward, backward, hardware, model_flops, parts, fill = _slowest_stage(shape, layout, cluster, layers_by_rank,
                                                                         act_bytes)
    if shape.gpt.moe_experts:  # the MoE blocks' router and experts in place of the dense MLP (moe.py)
        from parallel.planner.moe import with_moe_compute

        dense = forward, backward
        forward, backward, hardware, model_flops = with_moe_compute(
            shape, layout, cluster.device(), cluster.flops_per_rank(world), max(layers_by_rank), act_bytes,
            (forward, backward, hardware, model_flops))
        fill = (fill[0] + forward - dense[0], fill[1] + backward - dense[1])
    activation = layout.rank_tokens(shape.gpt.seq_len) * shape.gpt.d_model * act_bytes  # this rank's s/cp
    seconds = _collective_seconds(shape, layout, zero, grad_sync, cluster, traffic, activation, act_bytes)
    # tp, cp, ep: inside compute; the data-parallel groups' reductions overlap backward instead (`_dp_exposed`)
    blocking = sum(sec for name, sec in seconds.items() if name not in DATA_PARALLEL)
    hidden = tp_hidden_in_backward(shape, layout, cluster, traffic["tp"].span, layers_by_rank, act_bytes,
                                   blocking / (2 * m)) if cluster.tp_backward_overlap and "tp" in traffic else 0.0
    f_eff, b_eff = forward + blocking / (2 * m), backward + blocking / (2 * m) - hidden
    fill_eff = (fill[0] + blocking / (2 * m), fill[1] + blocking / (2 * m) - hidden)
    pp_exposed, bubble = _pipeline_exposed(layout, cluster, traffic, seconds, activation, f_eff, b_eff, fill_eff)
    dp_exposed = _dp_exposed(traffic, seconds, zero, grad_sync, m * b_eff if zero >= 2 else b_eff, world)
    compute = m * (forward + backward) + codec + optimizer + copies
    exposed = m * (f_eff - forward + b_eff - backward) + pp_exposed + dp_exposed
    return StepTime(compute, exposed, bubble, seconds, forward, backward, hardware, model_flops, parts, codec,
                    optimizer, copies)


def _slowest_stage(shape: ModelShape, layout, cluster: Cluster, layers_by_rank: list[int], act_bytes: int) -> tuple:
    """(forward, backward) seconds of one microbatch on the slowest stage, and, on a known device,
    the step's hardware and model FLOPs and the slowest stage's compute by part (else None); last,
    the other stages' mean (forward, backward), which the schedule's fill and drain run through."""
    dims, m, b = layout.dims, layout.microbatches, layout.microbatch_size
    p, t, g = dims.pp, dims.tp, shape.gpt
    rate = cluster.flops_per_rank(dims.world_size)
    tokens = layout.rank_tokens(g.seq_len)
    device = cluster.device()
    recompute = layout.recompute or "none"
    if device is None:
        forwards = [tokens * forward_flops_per_token(shape, t, n, r == p - 1) / rate
                    for r, n in enumerate(layers_by_rank)]
        slowest = max(range(p), key=lambda r: forwards[r])
        per = [{"forward": f, "backward": 2 * f + _recomputed_seconds(shape, t, n, tokens / rate, recompute)}
               for f, n in zip(forwards, layers_by_rank)]
        return per[slowest]["forward"], per[slowest]["backward"], None, None, None, _others(per, slowest)
    from parallel.planner.compute import microbatch_seconds

    cut = layout.cut()
    per = [microbatch_seconds(shape, device, t, b, n, r == p - 1, act_bytes, cut.sequence_parallel, recompute,
                              dims.cp, cut.cp_kind or "ring") for r, n in enumerate(layers_by_rank)]
    slowest = max(range(p), key=lambda r: per[r]["forward"] + per[r]["backward"])
    replicas = dims.tp * dims.dp * dims.cp * m
    hardware = replicas * sum(x["hardware_flops"] for x in per)
    model_flops = replicas * sum(x["model_flops"] for x in per)
    parts = {k: m * per[slowest][k] for k in ("matmuls", "attention", "elementwise", "recompute")}
    return per[slowest]["forward"], per[slowest]["backward"], hardware, model_flops, parts, _others(per, slowest)


def tp_hidden_in_backward(shape: ModelShape, layout, cluster: Cluster, span: GroupSpan, layers_by_rank: list[int],
                          act_bytes: int, backward_share: float) -> float:
    """Seconds per microbatch of the tp collectives that run beside backward's GEMMs where the cluster's
    framework overlaps them (`Cluster.tp_backward_overlap`: Megatron-LM's asynchronous tensor-parallel
    communication). In each block the column-parallel linears (QKV, the MLP's first) reduce their input
    gradient beside their weight-gradient GEMM (an all-reduce, or sequence parallelism's reduce-scatter), and
    where they keep their input's sequence piece, all-gather it again beside their input-gradient GEMM;
    each hides up to that GEMM's time, the mean rank's blocks, never more than backward's share of the
    blocking collectives. The row-parallel linears' collectives and the recomputed forward's stay exposed."""
    t, b, g = layout.dims.tp, layout.microbatch_size, shape.gpt
    cut = layout.cut()
    tensor = layout.rank_tokens(g.seq_len) * g.d_model * act_bytes
    reduction = (t - 1) / t * tensor * (1 if cut.sequence_parallel else 2)
    regather = (t - 1) / t * tensor if cut.sequence_parallel and cut.saves_shard else 0.0
    layers = sum(layers_by_rank) / len(layers_by_rank)
    comm = [layers * 2 * collective_seconds(x, span, cluster, tensor, 2 * (t - 1)) for x in (reduction, regather)]
    device = cluster.device()
    if device is not None:
        from parallel.planner.compute import Gemm, block_gemms

        gemms = block_gemms(shape, t, b, layout.dims.cp, cut.cp_kind or "ring")
        column = [x for i, x in enumerate(gemms["matmuls"]) if i in (0, 2)]
        weight_grad = layers * sum(device.seconds(Gemm(x.k, x.n, x.m), act_bytes) for x in column)
        input_grad = layers * sum(device.seconds(Gemm(x.m, x.k, x.n), act_bytes) for x in column)
        comm = [min(comm[0], weight_grad), min(comm[1], input_grad)]
    return min(sum(comm), backward_share)


def _recomputed_seconds(shape: ModelShape, t: int, layers: int, seconds_per_flop_token: float,
                        recompute: str) -> float:
    """Recomputation runs again in backward: every block's forward (full), or its attention core's
    4·s·h FLOPs per token (selective)."""
    if recompute == "full":
        return seconds_per_flop_token * forward_flops_per_token(shape, t, layers, False)
    if recompute == "selective":
        return seconds_per_flop_token * layers * 4 * shape.gpt.seq_len * shape.gpt.d_model / t
    return 0.0


def _others(per: list[dict], slowest: int) -> tuple[float, float]:
    """The mean (forward, backward) of the stages other than the slowest (the slowest's own with one stage)."""
    others = [x for r, x in enumerate(per) if r != slowest] or [per[slowest]]
    return (sum(x["forward"] for x in others) / len(others), sum(x["backward"] for x in others) / len(others))


def _collective_seconds(shape: ModelShape, layout, zero: int, grad_sync: str | None, cluster: Cluster,
                        traffic: dict, activation: int, act_bytes: int) -> dict:
    """Each group's collectives' seconds per step but the pipeline's sends (`_pipeline_exposed`); a
    periodic sync's (every H steps) is one sync's seconds over H."""
    t, world = layout.dims.tp, layout.dims.world_size
    seconds = {}
    for name, gt in traffic.items():
        per_rank = gt.per_rank(world) * gt.every
        if name == "pp":
            continue
        if name in DATA_PARALLEL:
            sharded = zero or name == "dp_shard"
            message = BUCKET_BYTES if grad_sync == "bucketed" and not sharded else \
                (shape.layer_parameters(t) * act_bytes if sharded else shape.layer_parameters(t) * act_bytes / 12)
            steps = gt.span.size - 1 if sharded and name != "dp_replicate" else 2 * (gt.span.size - 1)
        else:
            message, steps = activation, 2 * (gt.span.size - 1)
        direct = float(gt.direct) / world * gt.every  # an all-to-all: each block straight to its member
        seconds[name] = (collective_seconds(per_rank - direct, gt.span, cluster, message, steps)
                         + _direct_seconds(direct, gt.span, cluster, message)) / gt.every
    return seconds


def _direct_seconds(bytes_per_rank: float, span, cluster: Cluster, message: float) -> float:
    """An all-to-all's seconds: every block sent at once to its member, those to other nodes (the
    peers' share off-node, `direct_fraction`) at the between-node rate, the rest inside, one latency
    per peer."""
    if bytes_per_rank <= 0:
        return 0.0
    steps = span.size - 1
    return collective_seconds(bytes_per_rank, replace(span, inter_fraction=span.direct_fraction), cluster,
                              message, steps, point_to_point=True)


def _pipeline_exposed(layout, cluster: Cluster, traffic: dict, seconds: dict, activation: int, f_eff: float,
                      b_eff: float, fill: tuple[float, float] | None = None) -> tuple[float, float]:
    """(exposed seconds of the pipeline's sends, the bubble); records the sends' seconds in `seconds`.
    The bubble is the schedule's idle played with `fill`, the other stages' (forward, backward) that
    its fill and drain run through (the slowest stage's own where not given)."""
    dims, m, v = layout.dims, layout.microbatches, chunks_per_rank(layout)
    p, t = dims.pp, dims.tp
    if p == 1:
        return 0.0, 0.0
    boundary = activation // (t if layout.cut().sequence_parallel else 1)
    send = collective_seconds(boundary, traffic["pp"].span, cluster, boundary, 1, point_to_point=True) \
        if "pp" in traffic else 0.0
    seconds["pp"] = send * traffic["pp"].per_rank(dims.world_size) / boundary if "pp" in traffic else 0.0
    # The schedule is played with the costs themselves, unrounded: the bubble is a small difference of two
    # makespans, so a ratio rounded to a few digits would move it by many times that share.
    f_fill, b_fill = fill or (f_eff, b_eff)
    bubble = max(0.0, pipeline_makespan(layout, f_fill, b_fill, 0.0) - m * (f_fill + b_fill))
    if cluster.p2p_overlap:
        return 2 * (v * p - 1) * send, bubble
    with_sends = pipeline_makespan(layout, f_eff, b_eff, send)
    return max(0.0, with_sends - pipeline_makespan(layout, f_eff, b_eff, 0.0)), bubble


def _dp_exposed(traffic: dict, seconds: dict, zero: int, grad_sync: str | None, window: float, world: int) -> float:
    """The data-parallel groups' exposed seconds: their gathers, what of their reductions (summed over
    the groups: they follow one another in the same backward) the backward `window` does not hide,
    never less than the last bucket, and every periodic sync whole."""
    exposed, reduce, last = 0.0, 0.0, 0.0
    for name in DATA_PARALLEL:
        if name not in traffic:
            continue
        gt, sec = traffic[name], seconds[name]
        if gt.after_step:
            exposed += sec
            continue
        gather = sec * float(gt.gathers / gt.total) if gt.total else 0.0
        exposed += gather
        if grad_sync == "naive" or zero == 1:
            exposed += sec - gather
            continue
        reduce += sec - gather
        last = max(last, (sec - gather) * min(1.0, BUCKET_BYTES / max(gt.per_rank(world) - float(gt.gathers) / world,
                                                                      1.0)))
    return exposed + (max(reduce - window, last) if reduce else 0.0)
