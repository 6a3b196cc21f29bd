"""PyTorch's own parallelism on the same GPT, data and initialisation: the baselines.

  counting.py    their traffic counted into the project's communication log
  ddp.py         DistributedDataParallel, bare and under Hugging Face accelerate (for dp)
  fsdp2.py       FSDP2, fully_shard per Block and on the root (for zero3; without resharding after
                 forward, for zero2)
  fsdp2_hsdp.py  FSDP2 on a 2-D mesh (dp_replicate, dp_shard): HSDP (for hsdp)
  zero_redundancy.py  DDP + ZeroRedundancyOptimizer, PyTorch's ZeRO-1 (for zero1)
  dtensor_tp.py  DTensor tensor parallelism, torchtitan's plan (for tp)
  pipelining.py  torch.distributed.pipelining's schedules on the same chunks (for pp)
  rules.py       their refusals
  theory.py      the closed forms of the traffic PyTorch's own moves where it differs from ours

Each is a Strategy like ours, so the step loop, the summary and the comparison treat them alike;
their entries (below) carry the tag "baseline", and ours name them as `counterpart`.
"""

from __future__ import annotations

from parallel import algebra
from parallel.activations import registry_activations
from parallel.baselines import theory
from parallel.baselines.rules import (
    TORCH_PP_NO_MOE,
    TORCH_PP_NO_TIED_HEAD,
    TORCH_TP_NO_MOE,
    TORCH_TP_NO_TIED_HEAD,
    check_torch_pp,
    check_torch_pp_schedule,
    check_torch_tp,
    check_torch_tp_model,
)
from parallel.dp import theory as dp_theory
from parallel.pp import theory as pp_theory
from parallel.pp.options import PPOptions
from parallel.spec import StrategySpec
from parallel.sync.options import SyncOptions
from parallel.zero.rules import check_hsdp


def _optimizer(plan):
    from parallel.strategy import plan_optimizer

    return lambda module: plan_optimizer(module, plan)


def _build_torch_ddp(model, plan, ctx):
    from parallel.baselines.ddp import TorchDDP

    sync = plan.layout.of(SyncOptions)
    return TorchDDP(model, _optimizer(plan), ctx.comm("dp"), sync.bucket_mb, sync.comm_dtype)


def _build_accelerate_ddp(model, plan, ctx):
    from parallel.baselines.ddp import AccelerateDDP

    return AccelerateDDP(model, _optimizer(plan), ctx.comm("dp"), plan.layout.of(SyncOptions).bucket_mb, ctx.device)


def _build_torch_fsdp2(model, plan, ctx):
    from parallel.baselines.fsdp2 import TorchFSDP2

    return TorchFSDP2(model, ctx.mesh["dp"], ctx.comm("dp"), plan.lr, plan.weight_decay)


def _build_torch_hsdp(model, plan, ctx):
    from parallel.baselines.fsdp2_hsdp import TorchHSDP, hsdp_mesh

    shard, replicate = ctx.comm("dp_shard"), ctx.comm("dp_replicate")
    dp_ranks = next(g for g in ctx.dims.group_ranks("dp") if ctx.rank in g)
    mesh = hsdp_mesh(dp_ranks, shard, replicate, ctx.device.type)
    return TorchHSDP(model, mesh, ctx.comm("dp"), shard, replicate, plan.lr, plan.weight_decay)


def _build_torch_zero1(model, plan, ctx):
    from parallel.baselines.zero_redundancy import TorchZero1

    return TorchZero1(model, ctx.comm("dp"), plan.layout.of(SyncOptions).bucket_mb, plan.lr, plan.weight_decay)


def _build_torch_zero2(model, plan, ctx):
    from parallel.baselines.fsdp2 import TorchZero2

    return TorchZero2(model, ctx.mesh["dp"], ctx.comm("dp"), plan.lr, plan.weight_decay)


def _build_torch_tp(model, plan, ctx):
    from parallel.baselines.dtensor_tp import TorchTP

    return TorchTP(model, _optimizer(plan), ctx.mesh["tp"], ctx.comm("tp"), ctx.comm("dp"), ctx.log)


def _build_torch_pp(model, plan, ctx):
    from parallel.baselines.pipelining import TorchPipeline

    options = plan.layout.of(PPOptions)
    return TorchPipeline(model, options.schedule, ctx.comm("pp"), plan.microbatches, options.virtual_stages,
                         list(options.layers) if options.layers else None, plan.lr, plan.weight_decay, ctx.device,
                         ctx.log)


BASELINE = frozenset({"baseline"})
# FSDP2's: its copies around the collectives are its own ops (parallel/planner/shard_copies.py); ZeRO-2 as
# FSDP2 with reshard_after_forward=False keeps the gathered parameters for the step ("keeps_gathered").
FSDP2 = frozenset({"baseline", "sharded", "fsdp2"})
BUCKETS = {"sync": ("bucket_mb",)}  # DDP's own buckets, of parallel.bucket_mb; no choice of sync
PIPELINE = ("schedule", "virtual_stages", "layers")

# DTensor's TP (its loss runs on the all-gathered logits) and pipelining (its first stage holds
# more) save more for backward than ours: they have no activation formula.
ENTRIES = (
    StrategySpec(
        name="torch_ddp", description="PyTorch DistributedDataParallel (the baseline for dp)",
        build=_build_torch_ddp, comm=dp_theory.dp_comm, model_state=dp_theory.replicated_model_state_bytes,
        local_parameters=algebra.tp_local_parameter_count, min_world=2, exposed_comm_measured=False,
        honours={"sync": ("bucket_mb", "comm_dtype")},  # comm_dtype=bf16: PyTorch's bf16_compress_hook
        tags=BASELINE, moe=True, activations=registry_activations, tied_head=True, sgd=True,
    ),
    StrategySpec(
        name="accelerate_ddp", description="Hugging Face accelerate's Accelerator (DDP underneath)",
        build=_build_accelerate_ddp, comm=dp_theory.dp_comm, model_state=dp_theory.replicated_model_state_bytes,
        local_parameters=algebra.tp_local_parameter_count, min_world=2, honours=BUCKETS, exposed_comm_measured=False,
        tags=BASELINE, moe=True, activations=registry_activations, tied_head=True, sgd=True,
    ),
    StrategySpec(
        name="torch_fsdp2", description="PyTorch FSDP2, fully_shard per Block and on the root (the baseline for zero3)",
        build=_build_torch_fsdp2, comm=theory.fsdp2_comm, local_parameters=algebra.tp_local_parameter_count,
        min_world=2, tags=FSDP2, moe=True, activations=registry_activations,
        tied_head=True,
    ),
    StrategySpec(
        name="torch_hsdp", description="PyTorch FSDP2 on a 2-D mesh (dp_replicate, dp_shard): HSDP (the baseline for "
                                       "hsdp)",
        build=_build_torch_hsdp, comm=theory.torch_hsdp_comm, local_parameters=algebra.tp_local_parameter_count,
        dims=frozenset({"dp", "dp_shard"}), min_world=4, check=check_hsdp,
        tags=FSDP2, moe=True, activations=registry_activations, tied_head=True,
    ),
    StrategySpec(
        name="torch_zero1", description="PyTorch's ZeRO-1: DDP + ZeroRedundancyOptimizer (the baseline for zero1)",
        build=_build_torch_zero1, comm=theory.torch_zero1_comm, local_parameters=algebra.tp_local_parameter_count,
        min_world=2, honours=BUCKETS, exposed_comm_measured=False, tags=frozenset({"baseline", "sharded"}), moe=True,
        activations=registry_activations, tied_head=True,
    ),
    StrategySpec(
        name="torch_zero2", description="PyTorch's ZeRO-2: FSDP2 with reshard_after_forward=False (the baseline for "
                                        "zero2)",
        build=_build_torch_zero2, comm=theory.torch_zero2_comm, local_parameters=algebra.tp_local_parameter_count,
        min_world=2, tags=FSDP2 | {"keeps_gathered"}, moe=True, activations=registry_activations,
        tied_head=True,
    ),
    StrategySpec(
        name="torch_tp", description="PyTorch DTensor tensor parallelism, torchtitan's plan (the baseline for tp)",
        build=_build_torch_tp, comm=theory.torch_tp_comm, local_parameters=algebra.tp_local_parameter_count,
        dims=frozenset({"dp", "tp"}), min_world=2, honours={"tp": ()}, check=check_torch_tp, tags=BASELINE,
        check_model=check_torch_tp_model, moe_refusal=TORCH_TP_NO_MOE, tied_head_refusal=TORCH_TP_NO_TIED_HEAD,
        sgd=True,
    ),
    StrategySpec(
        name="torch_pp",
        description="torch.distributed.pipelining's schedules on the same chunks (the baseline for pp)",
        build=_build_torch_pp, comm=pp_theory.pipeline_comm, dims=frozenset({"pp"}), min_world=2,
        honours={"pp": PIPELINE},
        check=check_torch_pp, schedule_check=check_torch_pp_schedule, tags=BASELINE, moe_refusal=TORCH_PP_NO_MOE,
        tied_head_refusal=TORCH_PP_NO_TIED_HEAD,
    ),
)
