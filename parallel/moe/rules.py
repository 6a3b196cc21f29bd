"""Expert parallelism's refusals, checked by run_plan.py before any process group.

`ep` runs inside data parallelism only: tensor parallelism has no cut for an MoE block, a pipeline
stage cannot back-propagate its blocks' balancing loss, and context parallelism would route pieces
of sequences (docs/experts.md). It needs a mixture of experts whose experts divide over ep ranks.
"""

from __future__ import annotations

from parallel.core.model import GPTConfig
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.spec import ConfigError

# Why the other dimensions do not hold an MoE block: the words parallel/tp/rules.py and
# parallel/pp/rules.py give for their own refusal (a family does not import another).
WHY_NOT_TP_PP_CP = (
    "tensor parallelism cuts the dense MLP's fc and proj over tp ranks (parallelize_tp) and has no cut for an "
    "MoE block's router and experts, a pipeline stage that holds MoE blocks must back-propagate their balancing loss "
    "beside the gradient it receives, and the pipeline runner back-propagates the last stage's loss only, and context "
    "parallelism would route pieces of sequences (docs/experts.md)"
)


def check_ep_layout(dims: ParallelDims) -> None:
    if dims.tp > 1 or dims.pp > 1 or dims.cp > 1:
        raise LayoutError(
            f"parallel=ep runs expert parallelism inside data parallelism only, but parallel.tp={dims.tp} "
            f"parallel.pp={dims.pp} parallel.cp={dims.cp}: {WHY_NOT_TP_PP_CP}; set parallel.tp=1 parallel.pp=1 "
            "parallel.cp=1"
        )


def check_ep_model(model: GPTConfig, dims: ParallelDims) -> None:
    if not model.moe_experts:
        raise ConfigError("parallel=ep shards the experts of a mixture-of-experts model, but model.moe_experts=0: "
                          "use model=tiny_moe or model=small_moe, or parallel=dp for a dense model")
    if model.moe_experts % dims.ep:
        fits = max(e for e in range(1, dims.ep + 1) if model.moe_experts % e == 0 and dims.dp % e == 0)
        raise LayoutError(
            f"model.moe_experts={model.moe_experts} does not divide over parallel.ep={dims.ep} ranks (each holds "
            f"E/ep whole experts): use an ep that divides {model.moe_experts} and dp={dims.dp}, e.g. parallel.ep={fits}"
        )
