"""Which experts each token goes to: a softmax router, top-k choice, capacity and the balancing loss.

Pure functions of the router's logits; no modules, no communication. docs/theory/experts.md
derives every choice made here; in short:

* Router: p = softmax(x·W_r) over the E experts, computed in fp32 (Switch Transformer §2.4,
  "selective precision"). Each token takes its k most probable experts.
* Gate weights: k = 1 keeps the raw probability p_e (Switch; renormalising one weight would
  make it 1 and leave the router without a gradient from the task loss). k >= 2 renormalises the
  k chosen probabilities to sum to 1 (GShard's top-2 gate, Mixtral's softmax over the top-k).
  The renormalisation happens before dropping: a dropped assignment just loses its share.
* Routing group = one sequence. Capacity, drop order and the balancing loss are computed per
  sequence (GShard's "groups", Lepikhin et al. 2020 §2.2 and Algorithm 1), so they depend on the
  sequence alone, never on how a batch is cut into ranks and microbatches. That is what lets a
  data- or expert-parallel run drop exactly the tokens the single-process run drops.
* Capacity per expert and sequence: C = ceil(capacity_factor · s·k / E) (Switch §2.2 eq. 3 with
  tokens = the s tokens of one sequence), computed exactly (the factor read as a decimal).
* Drop order: within a sequence, every token's first choice in position order, then every
  token's second choice, ... (GShard Algorithm 1: the second expert's slots start after the
  first choices'). An assignment whose slot is >= C is dropped; a token whose every assignment
  is dropped leaves the MoE MLP as zeros and passes through the residual connection only.
* Balancing loss per sequence: aux = E · Σ_e f_e · P_e (Switch §2.2 eq. 4-6), f_e the fraction of
  the sequence's s·k assignments that chose expert e (before dropping), P_e the mean router
  probability of expert e over the sequence's s tokens. 1 under perfectly uniform routing.
  Returned as s · Σ_sequences aux, a sum over tokens like `token_loss_sum`, so that dividing by
  the global batch's token count gives the mean over sequences and it adds up over ranks and
  microbatches exactly as the token loss does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F


def expert_capacity(seq_len: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor · s·k / E): assignments one expert accepts from one sequence.

    The factor is read as the decimal it was written as (1.1 is 11/10, not the float nearest to
    it), so C is the same exact integer on every machine. C >= s never drops anything: one
    sequence has only s tokens, and a token chooses an expert at most once.
    """
    return math.ceil(Fraction(str(capacity_factor)) * seq_len * top_k / experts)


@dataclass
class Routing:
    """One routed batch of b sequences of s tokens, flattened to T = b·s tokens.

    The kept assignments are listed sorted by expert, and within an expert by flat token index
    (sequence, then position), so the rows of expert e are one contiguous run of `counts[e]` and
    the same tokens appear in the same order however the sequences were split across ranks.
    """

    token: torch.Tensor    # (A,) long: flat token index of each kept assignment
    weight: torch.Tensor   # (A,) fp32: its gate weight (differentiable: the router learns through it)
    expert: torch.Tensor   # (A,) long: its expert
    counts: torch.Tensor   # (E,) long: kept assignments per expert (sum A)
    routed: torch.Tensor   # (E,) long: assignments per expert before dropping (sum T·k)
    aux_sum: torch.Tensor  # scalar fp32: s · Σ_sequences E·Σ_e f_e·P_e (differentiable through P)

    @property
    def dropped(self) -> int:
        """Assignments dropped past capacity."""
        return int(self.routed.sum() - self.counts.sum())


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Route (b, s, E) router logits: top-k experts per token, gate weights, drops, balancing loss."""
    b, s, experts = logits.shape
    k = top_k
    probs = F.softmax(logits.float(), dim=-1)                       # (b, s, E)
    top_p, top_e = probs.topk(k, dim=-1)                            # (b, s, k), best first
    weights = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)

    # Slot of each assignment in its expert's buffer, in the drop order: choice-major, then position.
    chosen = F.one_hot(top_e, experts)                              # (b, s, k, E)
    in_order = chosen.transpose(1, 2).reshape(b, k * s, experts)    # (b, k·s, E)
    slot = in_order.cumsum(dim=1) - 1                               # 0-based slot where chosen
    kept_in_order = ((slot < capacity) & in_order.bool()).any(dim=-1)  # (b, k·s)
    kept = kept_in_order.view(b, k, s).transpose(1, 2)              # (b, s, k)

    # Switch's balancing loss per sequence, summed over tokens (s copies of each sequence's value).
    routed_per_sequence = chosen.sum(dim=(1, 2))                    # (b, E)
    f = routed_per_sequence.float() / (s * k)
    mean_prob = probs.mean(dim=1)                                   # (b, E)
    aux_sum = s * (experts * (f * mean_prob).sum(dim=-1)).sum()

    flat_token = torch.arange(b * s, device=logits.device).view(b, s, 1).expand(b, s, k)
    expert, token, weight = top_e[kept], flat_token[kept], weights[kept]
    order = torch.argsort(expert * (b * s) + token)                 # unique keys: expert, then token
    expert, token, weight = expert[order], token[order], weight[order]
    return Routing(
        token=token, weight=weight, expert=expert,
        counts=torch.bincount(expert, minlength=experts),
        routed=routed_per_sequence.sum(dim=0),
        aux_sum=aux_sum,
    )


def combine(expert_rows: torch.Tensor, routing: Routing, tokens: int) -> torch.Tensor:
    """Σ over a token's kept assignments of gate weight · expert output: (A, h) rows -> (T, h).

    Tokens with no kept assignment get zeros. With k <= 2 each token sums at most two terms onto
    zero, which is exact in any order, so this is deterministic even with a GPU's atomic adds.
    """
    weighted = expert_rows * routing.weight.to(expert_rows.dtype).unsqueeze(-1)
    out = expert_rows.new_zeros((tokens, expert_rows.shape[-1]))
    return out.index_add(0, routing.token, weighted)
