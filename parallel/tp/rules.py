"""Tensor parallelism's refusals, checked by plan.py before any process group.

The cut itself (heads, the padded vocabulary and, under sequence parallelism, the sequence must
divide over tp) is ParallelDims.check_tensor_parallel (parallel/dist/dims.py), which plan.py runs
for every entry that says `tensor_parallel=True`. Here: why tensor parallelism refuses a mixture of
experts, the line the registry's model check ends in (docs/experts.md).
"""

TP_NO_MOE = ("tensor parallelism cuts the dense MLP's fc and proj over tp ranks (parallelize_tp) and has no cut for an "
             "MoE block's router and experts")
