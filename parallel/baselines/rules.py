"""The refusals of PyTorch's own strategies, checked by run_plan.py before any process group.

What torch's implementation does not do here, said in the project's words: DTensor tensor
parallelism over one rank, under a pipeline or over kv heads tp does not divide,
torch.distributed.pipelining beside dp or tp, the schedules torch refuses for some (pp, m) that
ours run, and why neither trains a mixture of experts.
"""

from __future__ import annotations

from parallel.core.config import GPTConfig
from parallel.dist.dims import LayoutError, ParallelDims

TORCH_TP_NO_MOE = "DTensor's plan here (torchtitan's) shards the dense MLP and has no plan for an MoE block's experts"
TORCH_PP_NO_MOE = ("torch.distributed.pipelining back-propagates the last stage's loss only, not a stage's balancing "
                   "loss")
TORCH_TP_NO_TIED_HEAD = ("its plan distributes the token table and the head as two modules, and the one Parameter they "
                         "share then trains apart from the single run (its losses leave single's)")
TORCH_PP_NO_TIED_HEAD = ("torch.distributed.pipelining puts the embedding and the head on different stages, each of "
                         "which would train its own copy of the table")


def check_torch_tp(dims: ParallelDims) -> None:
    if dims.pp != 1:
        raise LayoutError(f"parallel=torch_tp does not pipeline, but parallel.pp={dims.pp}: set parallel.pp=1")
    if dims.tp < 2:
        raise LayoutError(f"parallel=torch_tp needs parallel.tp >= 2 (got {dims.tp}): "
                          "DTensor over one rank splits nothing")


def check_torch_tp_model(model: GPTConfig, dims: ParallelDims) -> None:
    """DTensor's plan cuts K and V by whole kv heads (ColwiseParallel), so tp must divide them, as in
    torchtitan; the hand-written tp, which holds each kv head on tp/kv ranks, does not need it."""
    if model.kv_heads % dims.tp:
        raise LayoutError(
            f"parallel=torch_tp with parallel.tp={dims.tp} and model.n_kv_heads={model.kv_heads}: DTensor's "
            f"ColwiseParallel cuts K and V by whole kv heads, so tp must divide them (torchtitan's "
            f"n_kv_heads % tp == 0): use a parallel.tp that divides {model.kv_heads}, or parallel=tp, which "
            "replicates each kv head on tp/kv ranks")


def check_torch_pp(dims: ParallelDims) -> None:
    if dims.tp != 1 or dims.dp != 1:
        raise LayoutError(
            f"parallel=torch_pp runs one torch.distributed.pipelining pipeline over the whole world, but "
            f"parallel.dp={dims.dp} and parallel.tp={dims.tp}: set parallel.dp=1 parallel.tp=1"
        )


def check_torch_pp_schedule(schedule: str, stages: int, microbatches: int, virtual: int) -> None:
    """torch's schedules' own rules (parallel/baselines/pipelining.py; it imports torch's pipelining)."""
    from parallel.baselines.pipelining import check_torch_schedule

    check_torch_schedule(schedule, stages, microbatches, virtual)
