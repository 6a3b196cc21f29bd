"""Cross-entropy over a vocabulary split across the tensor-parallel group, never gathering logits.

Rank r holds the logits of vocabulary entries [r·V/t, (r+1)·V/t) for every token. The loss of
one token is log(sum_j exp(z_j)) - z_target, computed stably as log(sum_j exp(z_j - M)) -
(z_target - M) with M the row maximum. Each piece is reduced across the group over b·s values,
not b·s·V:

    M          all-reduce MAX   of the local row maxima
    sum exp    all-reduce SUM   of the local sums of exp(z - M)
    z_target   all-reduce SUM   of the target's shifted logit (zero on the ranks not holding it)

Backward needs no communication: d loss / d z_j = softmax_j - [j = target], and each rank holds
the softmax of its own entries (their exp over the global sum) and knows whether the target is
one of them. This is Megatron's `vocab_parallel_cross_entropy`; it replaces
parallel.core.model.token_loss_sum (same meaning: the loss summed over every token, in fp32).
"""

from __future__ import annotations

import torch

from parallel.dist.comm import Communicator

TAG = "tp/loss/fwd"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, comm: Communicator):
        z = logits.float()
        row_max = z.max(dim=-1).values
        comm.all_reduce(row_max, tag=TAG, op="max")
        shifted = z - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, tag=TAG)

        local = targets - vocab_start
        outside = (local < 0) | (local >= z.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, tag=TAG)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        ctx.logits_dtype = logits.dtype
        return (sum_exp.log() - target_logit).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        one_hot_here = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -one_hot_here)
        return (grad * grad_loss).to(ctx.logits_dtype), None, None, None


def vocab_parallel_loss_sum(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                            comm: Communicator) -> torch.Tensor:
    """Summed token cross-entropy from this rank's vocabulary slice of the logits (b, s, V/t)."""
    return _VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, comm)
