"""Any dp x cp x tp x pp layout on one mesh: pipeline stages whose blocks are tensor-parallel, dp on top.

The world is the (pp, dp, tp) device mesh of parallel/dist/dims.py, rank = (pp·dp + dp_i)·tp + tp_i:
tp innermost, so the ranks of one tensor-parallel group are neighbours (one node, the fast links),
and pp outermost (the pipeline's point-to-point traffic is the lightest and may cross nodes).
Every rank sits in three groups and each carries one kind of traffic:

* tp (same stage, same dp slice): the Megatron collectives inside the stage's blocks, the
  vocab-parallel embedding (first stage) and loss (last stage), and under sequence parallelism
  the once-per-step sum of the sequence-sharded gradients;
* pp (same dp slice, same tp rank): activations forward and their gradients backward. Tp rank i of
  one stage sends to tp rank i of the next: the full b·s·h (every tp rank holds the whole residual
  stream between regions), or under sequence parallelism only its piece of the sequence,
  b·(s/tp)·h, which is exactly what the next stage's tp rank i needs (Megatron does the same);
* dp (same stage, same tp rank): the gradients of this rank's shard of its stage, once per step;
  or, with parallel.zero = 1 or 2, ZeRO over the dp group (parallel/sync/zero.py's ZeroOptimizer on
  the stage's local tp pieces): gradients reduce-scattered, each dp rank steps its 1/dp of the
  stage's optimizer state (stage 2: and keeps only that share of the gradients), the updated
  parameters all-gathered.

* cp (same stage, same dp slice, same tp rank; only with parallel.cp > 1): each rank holds two
  chunks of every sequence (parallel/cp/layout.py), and its attention cores (over this tp rank's
  heads) pass K, V around the ring or trade tokens for heads by all-to-all. Every parameter is then
  replicated over dp and cp: the gradient sum (or ZeRO) is over the "dp_cp" group instead of dp,
  and a stage boundary carries b·(s/cp)·h (b·(s/cp/tp)·h under sequence parallelism).

The model is built whole from the seed, then transformed in the design's order: tensor
parallelism first (`parallelize_tp`, which also names every tp collective after the global layer
index), then context parallelism (`parallelize_cp`: global positions in the embedding, a cp core
in every block, over the heads tp left this rank), then the pipeline cut (`split_model`), then the
dp gradient sync over the stage's own parameters. `build_combined` is a recipe: it makes those parts
and hands them to the schedule runner (parallel/pp/executor.py), which knows nothing of tp, cp or
ZeRO (under cp, `ContextParallelPipeline` only cuts each microbatch to this rank's tokens first).
With tp = 1 the recipe is plain pipeline parallelism (`parallel=pp`); with pp = 1 it is tp with dp
(or ZeRO) on one stage.
"""

from __future__ import annotations

import torch.nn as nn

from parallel.compose.cp_pipeline import ContextParallelPipeline
from parallel.core.model import GPT, token_loss_sum
from parallel.cp.transform import parallelize_cp
from parallel.dist.groups import link_groups
from parallel.pp.executor import PipelineParallel, global_named_parameters
from parallel.pp.options import PPOptions
from parallel.pp.posting import pipeline_links, posting_for
from parallel.pp.schedules import schedule_placement
from parallel.pp.split import split_model
from parallel.strategy import make_optimizer
from parallel.sync.allreduce import make_grad_sync
from parallel.sync.options import SyncOptions
from parallel.sync.zero import ZeroOptimizer
from parallel.tp.layers import parallelize_tp
from parallel.tp.loss import vocab_parallel_loss_sum
from parallel.tp.options import TPOptions
from parallel.tp.shards import TPShards, tp_grad_completions


def build_combined(model: GPT, plan, ctx) -> PipelineParallel:
    """dp x cp x tp x pp (any of them 1) from the plan's layout and the run's communicators."""
    tp_comm = ctx.comm("tp") if ctx.comm("tp") is not None and ctx.comm("tp").size > 1 else None
    cp_comm = ctx.comm("cp") if ctx.comm("cp") is not None and ctx.comm("cp").size > 1 else None
    # The ranks that hold the same parameters: dp, or dp and cp together when the sequence is split.
    pp_comm, dp_comm = ctx.comm("pp"), ctx.comm("dp_cp") if cp_comm is not None else ctx.comm("dp")
    cut, pipeline, dp_options = plan.layout.cut(), plan.layout.of(PPOptions), plan.layout.of(SyncOptions)
    sequence_parallel = cut.sequence_parallel
    full_parameters = sum(p.numel() for p in model.parameters())
    # 1. Tensor parallelism on the whole model: the shards keep the single-process names, and the
    #    tp tags the global layer index, whichever stage a block then lands on (tp's options say
    #    whether the sequence is cut, and what the column-parallel linears keep).
    shards = parallelize_tp(model, tp_comm, plan.layout.of(TPOptions)) if tp_comm is not None else TPShards()
    if cp_comm is not None:  # 1b. context parallelism on the tp shard: positions and attention cores
        parallelize_cp(model, cp_comm, cut.cp_kind)
    # 2. The pipeline cut: this rank's chunks (virtual stages r, r + p, ... on the loop; r and
    #    2p-1-r on the V of zbv and dualpipev).
    placement = schedule_placement(pipeline.schedule, pp_comm.size, pipeline.virtual_stages)
    chunks = split_model(model, pp_comm.size, pipeline.virtual_stages, pp_comm.rank,
                         list(pipeline.layers) if pipeline.layers else None, placement)
    # How the stages post their sends and receives: the backend's own posting unless parallel.pp_posting
    # says; NCCL's posts each on its link, a 2-rank group of one direction (parallel/pp/posting.py).
    posting = posting_for(pipeline.posting, plan.backend)  # the posting the validator proved
    links = link_groups(ctx, pipeline_links(placement)) if posting == "nccl" and pp_comm.size > 1 else {}
    named = global_named_parameters(chunks)
    # 3. The dp dimension over this stage's own parameters: plain all-reduce, or ZeRO-1/2 (the
    #    ZeroOptimizer is then the sync and the optimizer in one, its parts the stage's pieces).
    if dp_options.zero:
        sync = optimizer = ZeroOptimizer(named, dp_comm, dp_options.zero, plan.lr, plan.weight_decay)
    else:
        sync = make_grad_sync(named, dp_comm, dp_options.grad_sync, dp_options.bucket_mb)
        optimizer = make_optimizer(nn.ModuleList(chunks), plan.lr, plan.weight_decay)
    # This stage's share of the sequence-sharded replicated parameters (its blocks' norms and
    # row-parallel biases; the positions on the first stage, the final norm on the last) and of the
    # kv replicas (K and V where tp exceeds the kv heads): their partial gradients are completed
    # over tp where the dp sync says it is right.
    sync.completions += tp_grad_completions(shards, dict(named))

    if tp_comm is not None:
        # The head is vocab-parallel: the last chunk's output is this rank's slice of the logits.
        def stage_loss(out, targets):
            return vocab_parallel_loss_sum(out, targets, shards.vocab_start, tp_comm)
    else:
        stage_loss = token_loss_sum
    runner = dict(cp_comm=cp_comm) if cp_comm is not None else {}
    return (ContextParallelPipeline if cp_comm is not None else PipelineParallel)(
        chunks, **runner, pp_comm=pp_comm, dp_comm=dp_comm, schedule=pipeline.schedule,
        microbatches=plan.microbatches, virtual=pipeline.virtual_stages, optimizer=optimizer, sync=sync,
        full_parameters=full_parameters, d_model=model.config.d_model,
        stage_loss=stage_loss, shards=shards, tp_comm=tp_comm, posting=posting, links=links,
        # Under sequence parallelism tp rank i of one stage sends only its piece of the sequence,
        # b·(s/tp)·h, exactly what tp rank i of the next stage needs (Megatron does the same).
        boundary_seq_parts=tp_comm.size if sequence_parallel else 1,
    )
