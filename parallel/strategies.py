"""The registry's entries: every strategy of the project and PyTorch's own, in one table.

Each entry says how the strategy is built from the full model, the validated plan and the run's
communicators (parallel/dist/groups.py's DistContext), which closed forms (parallel/algebra.py
and the families' theory.py files) its traffic and memory must equal, and which layout rules apply
(parallel/registry.py).
"""

from __future__ import annotations

from parallel import activations, algebra
from parallel.baselines import theory as baselines_theory
from parallel.compose import theory as compose_theory
from parallel.cp import theory as cp_theory
from parallel.dist.dims import LayoutError
from parallel.dp import theory as dp_theory
from parallel.moe import theory as moe_theory
from parallel.pp import theory as pp_theory
from parallel.registry import REGISTRY, ConfigError, Options, StrategySpec, register
from parallel.strategy import SingleProcess, make_optimizer
from parallel.tp import theory as tp_theory
from parallel.zero import theory as zero_theory


def _optimizer(plan):
    return lambda module: make_optimizer(module, plan.lr, plan.weight_decay)


# -- one process ----------------------------------------------------------------------------------
register(StrategySpec(
    name="single", description="one process, no communication: the reference every strategy is compared with",
    build=lambda model, plan, ctx: SingleProcess(model, make_optimizer(model, plan.lr, plan.weight_decay)),
    comm=algebra.no_comm, model_state=dp_theory.replicated_model_state_bytes,
    local_parameters=algebra.tp_local_parameter_count, max_world=1, dims=frozenset(), moe=True,
    activations=activations.activation_bytes, recompute=True,
))


def _to_single_in_one_process(dims, options):
    """`parallel=dp` (or pp, 3d) in one plain process is the single-process run (asking for ZeRO
    over it is refused instead, by the ZeRO routing: there is nothing to shard over)."""
    return ("single", options) if dims.world_size == 1 and not options.zero else None


# -- data parallel ----------------------------------------------------------------------------------
def _build_dp(model, plan, ctx):
    from parallel.dp.strategy import DataParallel

    return DataParallel(model, make_optimizer(model, plan.lr, plan.weight_decay), ctx.comm("dp"), plan.grad_sync,
                        plan.bucket_mb)


register(StrategySpec(
    name="dp", description="data parallel, hand-written: gradients all-reduced over dp (naive, or bucketed as DDP)",
    build=_build_dp, comm=dp_theory.dp_comm, model_state=dp_theory.replicated_model_state_bytes,
    local_parameters=algebra.tp_local_parameter_count, grad_sync=True, zero_dp=True,
    route=lambda dims, options: _to_single_in_one_process(dims, options), counterpart="torch_ddp", moe=True,
    activations=activations.activation_bytes, recompute=True,
))


def _build_zero(stage):
    def build(model, plan, ctx):
        from parallel.zero.strategy import ZeroDataParallel

        return ZeroDataParallel(model, ctx.comm("dp"), stage, plan.lr, plan.weight_decay)
    return build


def _build_zero3(model, plan, ctx):
    from parallel.zero.zero3 import Zero3

    return Zero3(model, ctx.comm("dp"), plan.lr, plan.weight_decay)


for _stage, _what, _build in ((1, "optimizer state", _build_zero(1)),
                              (2, "optimizer state and gradients", _build_zero(2)),
                              (3, "optimizer state, gradients and parameters", _build_zero3)):
    register(StrategySpec(
        name=f"zero{_stage}", description=f"ZeRO stage {_stage}: {_what} sharded over dp",
        build=_build, comm=lambda cfg, layout, stage=_stage: zero_theory.zero_comm(cfg, layout, stage),
        model_state=lambda cfg, layout, stage=_stage: zero_theory.zero_model_state_bytes(cfg, layout, stage),
        local_parameters=algebra.tp_local_parameter_count, min_world=2, tags=frozenset({"sharded"}),
        counterpart="torch_fsdp2" if _stage == 3 else "torch_ddp", moe=True,
        # ZeRO-1/2 run the whole model's forward as dp does (recomputation and the activation formula
        # apply); zero3's hooks gather each part's parameters around one forward per backward.
        activations=activations.activation_bytes if _stage < 3 else (lambda cfg, layout: None), recompute=_stage < 3,
    ))


# -- tensor parallel, pipeline parallel, and all of them on one mesh --------------------------------
def _build_tp(model, plan, ctx):
    from parallel.tp.strategy import TensorParallel

    return TensorParallel(model, _optimizer(plan), ctx.comm("tp"), ctx.comm("dp"), plan.sequence_parallel,
                          plan.grad_sync, plan.bucket_mb)


def _build_mesh3d(model, plan, ctx):
    from parallel.compose.mesh3d import build_mesh3d

    return build_mesh3d(model, plan, ctx)


def _tp_route(dims, options):
    """Tensor parallelism over one rank is data parallelism (sequence parallelism over one rank cuts
    nothing); with pipeline stages or context parallelism too it is the one dp x cp x tp x pp strategy."""
    if dims.pp > 1 or dims.cp > 1:
        return "3d", options
    if dims.tp == 1:
        return "dp", Options(False, options.zero)
    return None


def _pp_route(dims, options):
    """A pipeline of tensor-parallel (or context-parallel) stages is the one dp x cp x tp x pp strategy."""
    if dims.tp > 1 or dims.cp > 1:
        return "3d", options
    return _to_single_in_one_process(dims, options)


# Why tensor and pipeline parallelism refuse a mixture of experts (docs/experts.md).
TP_NO_MOE = ("tensor parallelism cuts the dense MLP's fc and proj over tp ranks (parallelize_tp) and has no cut for an "
             "MoE block's router and experts")
PP_NO_MOE = ("a pipeline stage that holds MoE blocks must back-propagate their balancing loss beside the gradient it "
             "receives, and the pipeline runner back-propagates the last stage's loss only")

register(StrategySpec(
    name="tp", description="tensor parallel (Megatron), optionally with sequence parallelism; dp across tp groups",
    build=_build_tp, comm=tp_theory.tp_comm, local_parameters=algebra.tp_local_parameter_count,
    dims=frozenset({"dp", "tp"}), tensor_parallel=True, sequence_parallel=True, grad_sync=True, zero_dp=True,
    route=_tp_route, counterpart="torch_tp", moe_refusal=TP_NO_MOE, recompute=True,
))
register(StrategySpec(
    name="pp", description="pipeline parallel: GPipe, 1F1B, interleaved, ZB-H1, ZB-V or DualPipeV, schedules as data",
    build=_build_mesh3d, comm=pp_theory.pipeline_comm, dims=frozenset({"dp", "pp"}), pipelined=True,
    grad_sync=True, zero_dp=True, route=_pp_route, counterpart="torch_pp", moe_refusal=PP_NO_MOE, recompute=True,
))
register(StrategySpec(
    name="3d", description="dp x cp x tp x pp on one mesh: tensor-parallel pipeline stages, context-parallel "
    "attention, dp or ZeRO-1/2 on top",
    build=_build_mesh3d, comm=compose_theory.mesh3d_comm,
    model_state=compose_theory.mesh3d_first_stage_model_state_bytes,
    local_parameters=compose_theory.mesh3d_first_stage_parameter_count, dims=frozenset({"dp", "cp", "tp", "pp"}),
    tensor_parallel=True, pipelined=True, sequence_parallel=True, grad_sync=True, zero_dp=True, recompute=True,
    route=lambda dims, options: _to_single_in_one_process(dims, options), moe_refusal=f"{TP_NO_MOE}, and {PP_NO_MOE}",
))


# -- PyTorch's own, as baselines ----------------------------------------------------------------------
def _build_torch_ddp(model, plan, ctx):
    from parallel.baselines.ddp import TorchDDP

    return TorchDDP(model, _optimizer(plan), ctx.comm("dp"), plan.bucket_mb)


def _build_accelerate_ddp(model, plan, ctx):
    from parallel.baselines.ddp import AccelerateDDP

    return AccelerateDDP(model, _optimizer(plan), ctx.comm("dp"), plan.bucket_mb, ctx.device)


def _build_torch_fsdp2(model, plan, ctx):
    from parallel.baselines.fsdp2 import TorchFSDP2

    return TorchFSDP2(model, ctx.mesh["dp"], ctx.comm("dp"), plan.lr, plan.weight_decay)


def _build_torch_tp(model, plan, ctx):
    from parallel.baselines.dtensor_tp import TorchTP

    return TorchTP(model, _optimizer(plan), ctx.mesh["tp"], ctx.comm("tp"), ctx.comm("dp"), ctx.log)


def _build_torch_pp(model, plan, ctx):
    from parallel.baselines.pipelining import TorchPipeline

    return TorchPipeline(model, plan.schedule, ctx.comm("pp"), plan.microbatches, plan.virtual_stages,
                         list(plan.pp_layers) if plan.pp_layers else None, plan.lr, plan.weight_decay, ctx.device,
                         ctx.log)


def _torch_tp_check(dims, options):
    if dims.pp != 1:
        raise LayoutError(f"parallel=torch_tp does not pipeline, but parallel.pp={dims.pp}: set parallel.pp=1")
    if dims.tp < 2:
        raise LayoutError(f"parallel=torch_tp needs parallel.tp >= 2 (got {dims.tp}): "
                          "DTensor over one rank splits nothing")


def _torch_pp_schedule_check(schedule, stages, microbatches, virtual):
    from parallel.baselines.pipelining import check_torch_schedule

    check_torch_schedule(schedule, stages, microbatches, virtual)


def _torch_pp_check(dims, options):
    if dims.tp != 1 or dims.dp != 1:
        raise LayoutError(
            f"parallel=torch_pp runs one torch.distributed.pipelining pipeline over the whole world, but "
            f"parallel.dp={dims.dp} and parallel.tp={dims.tp}: set parallel.dp=1 parallel.tp=1"
        )


BASELINE = frozenset({"baseline"})
register(StrategySpec(
    name="torch_ddp", description="PyTorch DistributedDataParallel (the baseline for dp, zero1, zero2)",
    build=_build_torch_ddp, comm=dp_theory.dp_comm, model_state=dp_theory.replicated_model_state_bytes,
    local_parameters=algebra.tp_local_parameter_count, min_world=2, bucket_mb=True, exposed_comm_measured=False,
    tags=BASELINE, moe=True,
))
register(StrategySpec(
    name="accelerate_ddp", description="Hugging Face accelerate's Accelerator (DDP underneath)",
    build=_build_accelerate_ddp, comm=dp_theory.dp_comm, model_state=dp_theory.replicated_model_state_bytes,
    local_parameters=algebra.tp_local_parameter_count, min_world=2, bucket_mb=True, exposed_comm_measured=False,
    tags=BASELINE, moe=True,
))
register(StrategySpec(
    name="torch_fsdp2", description="PyTorch FSDP2, fully_shard per Block and on the root (the baseline for zero3)",
    build=_build_torch_fsdp2, comm=baselines_theory.fsdp2_comm, local_parameters=algebra.tp_local_parameter_count,
    min_world=2, tags=frozenset({"baseline", "sharded"}), moe=True,
))
register(StrategySpec(
    name="torch_tp", description="PyTorch DTensor tensor parallelism, torchtitan's plan (the baseline for tp)",
    build=_build_torch_tp, comm=baselines_theory.torch_tp_comm, local_parameters=algebra.tp_local_parameter_count,
    dims=frozenset({"dp", "tp"}), min_world=2, tensor_parallel=True, check=_torch_tp_check, tags=BASELINE,
    moe_refusal="DTensor's plan here (torchtitan's) shards the dense MLP and has no plan for an MoE block's experts",
))
register(StrategySpec(
    name="torch_pp", description="torch.distributed.pipelining's schedules on the same chunks (the baseline for pp)",
    build=_build_torch_pp, comm=pp_theory.pipeline_comm, dims=frozenset({"pp"}), min_world=2, pipelined=True,
    check=_torch_pp_check, schedule_check=_torch_pp_schedule_check, tags=BASELINE,
    moe_refusal="torch.distributed.pipelining back-propagates the last stage's loss only, not a stage's balancing loss",
))


# -- mixture of experts: expert parallelism ---------------------------------------------------------
def _build_ep(model, plan, ctx):
    from parallel.moe.strategy import ExpertParallel

    return ExpertParallel(model, ctx.comm("dp"), ctx.comm("ep"), ctx.comm("edp"), plan.grad_sync, plan.bucket_mb,
                          plan.lr, plan.weight_decay)


def _ep_route(dims, options):
    """Expert parallelism over one rank holds every expert on every rank: data parallelism."""
    return ("dp", options) if dims.ep == 1 else None


def _ep_check(dims, options):
    if dims.tp > 1 or dims.pp > 1 or dims.cp > 1:
        raise LayoutError(
            f"parallel=ep runs expert parallelism inside data parallelism only, but parallel.tp={dims.tp} "
            f"parallel.pp={dims.pp} parallel.cp={dims.cp}: {TP_NO_MOE}, {PP_NO_MOE}, and context parallelism "
            "would route pieces of sequences (docs/experts.md); set parallel.tp=1 parallel.pp=1 parallel.cp=1"
        )


def _ep_check_model(model, dims):
    if not model.moe_experts:
        raise ConfigError("parallel=ep shards the experts of a mixture-of-experts model, but model.moe_experts=0: "
                          "use model=tiny_moe or model=small_moe, or parallel=dp for a dense model")
    if model.moe_experts % dims.ep:
        fits = max(e for e in range(1, dims.ep + 1) if model.moe_experts % e == 0 and dims.dp % e == 0)
        raise LayoutError(
            f"model.moe_experts={model.moe_experts} does not divide over parallel.ep={dims.ep} ranks (each holds "
            f"E/ep whole experts): use an ep that divides {model.moe_experts} and dp={dims.dp}, e.g. parallel.ep={fits}"
        )


register(StrategySpec(
    name="ep", description="expert parallelism: each MoE block's experts sharded over ep ranks, tokens carried by "
                           "all-to-all; inside dp (dense gradients over dp, experts' over edp)",
    build=_build_ep, comm=moe_theory.ep_comm, model_state=moe_theory.ep_model_state_bytes,
    local_parameters=moe_theory.ep_local_parameter_count, dims=frozenset({"dp", "ep"}), min_world=2, grad_sync=True,
    check=_ep_check, check_model=_ep_check_model, route=_ep_route, moe=True,
))


# -- context parallelism: the sequence split over cp ranks (parallel/cp/) ----------------------------
def _build_cp(model, plan, ctx):
    from parallel.cp.strategy import ContextParallel

    return ContextParallel(model, ctx.comm("cp"), ctx.comm("dp_cp"), plan.cp_kind, grad_sync=plan.grad_sync,
                           bucket_mb=plan.bucket_mb, zero=plan.zero, lr=plan.lr, weight_decay=plan.weight_decay)


def _cp_route(dims, options):
    """With tensor or pipeline parallelism too, the one dp x cp x tp x pp recipe runs it (the cp kind
    travels in the options); over one cp rank there is no sequence to split: data parallelism."""
    if dims.tp > 1 or dims.pp > 1:
        return "3d", options
    if dims.cp == 1:
        return "dp", options
    return None


for _name, _kind, _what in (("cp", "ring", "ring attention: K, V blocks passed around the cp ring"),
                            ("cp_a2a", "a2a", "all-to-all (Ulysses): tokens traded for heads around attention")):
    register(StrategySpec(
        name=_name, description=f"context parallel, {_what}; gradients summed over dp x cp",
        build=_build_cp, comm=cp_theory.cp_comm, model_state=cp_theory.cp_model_state_bytes,
        local_parameters=algebra.tp_local_parameter_count, activations=activations.activation_bytes,
        dims=frozenset({"dp", "cp"}), min_world=2, grad_sync=True, zero_dp=True, recompute=True, cp_kind=_kind,
        route=_cp_route,
    ))


# -- activation memory: the bytes each rank saves for backward (parallel/activations.py) ---------------
# Measured on every run (parallel/report/activations.py) and checked against this formula by
# tests/tools/test_planner_memory.py. PyTorch's DTensor TP (its loss runs on the all-gathered logits) and
# pipelining (its first stage holds more: +17% at 4 stages) save more than ours: they have none.
def _with_activations(name: str) -> None:
    from dataclasses import replace

    REGISTRY[name] = replace(REGISTRY[name], activations=pp_theory.pipeline_activations)


for _name in ("single", "dp", "zero1", "zero2", "zero3", "tp", "pp", "3d",
              "torch_ddp", "accelerate_ddp", "torch_fsdp2", "cp", "cp_a2a"):
    _with_activations(_name)
