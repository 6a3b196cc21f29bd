"""The gradient syncs: how the ranks that hold the same parameters agree on one update.

Every family that replicates parameters over some group (dp, and dp x cp under context
parallelism, each pipeline stage's dp group, the expert-data-parallel ranks of a mixture of
experts) ends its step with one of these. They sit one floor below the families so that no family
imports another: dp, zero, tp, cp, moe and the recipe all plug in the same syncs.

  allreduce.py  the all-reduce syncs: naive (one all-reduce per gradient after backward) and
                bucketed (DDP's flat buckets, all-reduced while backward goes on)
  shards.py     the machinery ZeRO is made of: each model part as one flat buffer padded to a
                multiple of the group size, an AdamW over this rank's shard, the reduce-scatter
  zero.py       ZeroOptimizer: ZeRO stage 1 or 2 over any group, the sync and the optimizer in one

Each sync is a `parallel.strategy.GradSync`: what a step calls after backward (`finish`), and the
completions other families hang on it (tp's sum of sequence-sharded gradients).
"""
