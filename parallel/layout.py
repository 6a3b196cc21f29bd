"""How one optimizer step is split across ranks: everything the closed forms need besides the model.

A `Layout` is the part of a run's plan that decides traffic and memory: the (dp, tp, pp) grid,
the microbatches, sequence parallelism, the pipeline's chunks and the ZeRO stage of the dp
dimension (and, for expert parallelism, the step's routing). The closed forms (parallel/algebra.py,
the families' theory.py) take (GPTConfig, Layout); a run builds its Layout from the validated plan
(`RunPlan.layout`), and a planner can build one for a layout it never runs.

Context parallelism (dims.cp > 1) adds which attention crosses the cp ranks (`cp_kind`: the ring or
the all-to-all, parallel/cp/), and activation recomputation (`recompute`, parallel/core/recompute.py)
changes both the bytes saved for backward and, where the recomputed forward communicates, the traffic;
so does `tp_saves` under sequence parallelism (the column-parallel inputs kept whole or as this rank's
piece, the piece gathered again in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.dist.dims import ParallelDims

FP32_BYTES = 4


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    microbatches: int = 1
    microbatch_size: int = 1  # sequences per microbatch on each dp rank
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_layers: tuple[int, ...] | None = None  # explicit blocks per virtual stage; None: an even split
    zero: int = 0  # ZeRO stage of the dp dimension of a combined layout (zero1/2/3 carry theirs in the name)
    dtype_bytes: int = FP32_BYTES  # of parameters, gradients and the activations that cross ranks
    # Mixture of experts: where the router sent the tokens, which sets expert parallelism's all-to-all
    # bytes. routing[rank][call][e]: kept assignments to expert e of each MoE call (block, microbatch,
    # in the order run) of the step, on every global rank, as measured in a run; None: a layout
    # never run, whose all-to-alls theory figures under uniform routing (parallel/moe/theory.py).
    routing: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    cp_kind: str = "ring"  # attention across the cp ranks (dims.cp > 1): "ring" or "a2a" (all-to-all)
    recompute: str = "none"  # train.recompute: none | selective (attention cores) | full (every Block)
    precision: str = "fp32"  # train.precision: under bf16 the activations that cross ranks inside a block are bf16
    # parallel.tp_saves, under sequence parallelism: what each column-parallel linear keeps for its weight
    # gradient, the all-gathered input ("gathered") or this rank's piece of it, gathered again in backward
    # ("sharded", as Megatron-LM does; parallel/tp/regions.py)
    tp_saves: str = "gathered"
