"""The one GPT every strategy trains.

A decoder-only transformer in the GPT-2 shape: learned token and position embeddings,
pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and an
untied LM head. There is no distributed code here: the parallel strategies take this model,
built identically on every rank from one seed, and transform it (shard, split, wrap).

The model is split into three parts so that a pipeline can cut it later without rewriting it:
`embed` (tokens -> hidden), `blocks` (hidden -> hidden) and `head` (hidden -> logits).

With `moe_experts` > 0 some blocks replace their MLP by a mixture of experts (`MoEMLP`: a router
and `moe_experts` MLPs of the dense shape; routing in parallel/core/routing.py, the theory in
docs/theory/experts.md). With the default `moe_experts=0` the model is the dense GPT, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.core.routing import combine, expert_capacity, route

# The GPTConfig fields of a mixture of experts, spelled as in conf/model/*.yaml.
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor", "moe_aux_weight")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level text
    seq_len: int = 32
    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    # Megatron pads the vocabulary so that the embedding and head split evenly across TP ranks
    # and the matmuls get friendly shapes; 256 bytes are already a multiple of 64.
    vocab_pad_multiple: int = 64
    # Mixture of experts (0 experts: the dense model; the other moe_* fields are then ignored).
    moe_experts: int = 0             # E: experts per MoE block
    moe_top_k: int = 1               # k: experts each token goes to (1 <= k <= E)
    moe_every: int = 1               # block i is an MoE block iff i % moe_every == 0 (0-based)
    moe_capacity_factor: float = 1.25  # C = ceil(factor · s·k / E) assignments per expert per sequence
    moe_aux_weight: float = 0.01     # α: weight of Switch's load-balancing loss (Switch uses 1e-2)

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "mlp_ratio", "vocab_pad_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "pick a head count that divides the width "
                f"(e.g. model.n_heads={_largest_divisor_at_most(self.d_model, self.n_heads)})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        self._check_moe()

    def _check_moe(self) -> None:
        if not isinstance(self.moe_experts, int) or isinstance(self.moe_experts, bool) or self.moe_experts < 0:
            raise ValueError(
                f"model.moe_experts={self.moe_experts!r} must be a non-negative integer (0: a dense model)")
        if not self.moe_experts:
            return
        for name in ("moe_top_k", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if self.moe_top_k > self.moe_experts:
            raise ValueError(
                f"model.moe_top_k={self.moe_top_k} is more than model.moe_experts={self.moe_experts}: a token "
                f"chooses k distinct experts, so set model.moe_top_k <= {self.moe_experts}"
            )
        for name, low in (("moe_capacity_factor", "> 0"), ("moe_aux_weight", ">= 0")):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or (value <= 0 if low == "> 0" else value < 0):
                raise ValueError(f"model.{name}={value!r} must be a finite number {low}")

    def is_moe_block(self, index: int) -> bool:
        """Block `index` (0-based) is an MoE block iff the model has experts and index % moe_every == 0:
        every block for moe_every=1, blocks 0, 2, 4, ... for 2 (Megatron-Core's moe_layer_freq)."""
        return self.moe_experts > 0 and index % self.moe_every == 0

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_moe_block(i))

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def d_ff(self) -> int:
        return self.mlp_ratio * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, k + 1) if n % d == 0)


class AttentionCore(nn.Module):
    """Causal attention proper: softmax(Q·Kᵀ/√d + mask)·V over (batch, heads, seq, head_dim).

    It has no weights, and it is the only part of a block whose memory grows with the square of
    the sequence. A module of its own so that a strategy can replace it (context parallelism runs
    it over a sequence split across ranks) or wrap it (selective recomputation) without touching
    the rest of the block.
    """

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        # Separate Q, K and V projections (not one fused qkv matrix) so that tensor parallelism can
        # cut each along its heads without reshuffling a fused weight.
        self.q = nn.Linear(config.d_model, config.d_model)
        self.k = nn.Linear(config.d_model, config.d_model)
        self.v = nn.Linear(config.d_model, config.d_model)
        self.core = AttentionCore(config.dropout)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads are read off the projection's own output width, so a shard that holds only some
        # heads (tensor parallelism) runs this same code.
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoEMLP(nn.Module):
    """A mixture of E MLPs of the dense shape, k of which each token goes through.

    y_t = Σ over t's kept assignments (t, e) of g_{t,e} · MLP_e(x_t): the router picks each token's
    top-k experts and gate weights g (parallel/core/routing.py: raw probability for k = 1, the k
    probabilities renormalised for k >= 2); each expert runs on its contiguous run of rows (the
    assignments sorted by expert); past an expert's capacity per sequence assignments are
    dropped. A token with no kept assignment gets zeros here and keeps its residual stream.

    After each forward, `aux_loss_sum` holds α · s · Σ_sequences E·Σ_e f_e·P_e (Switch's balancing
    loss as a sum over tokens; see `training_loss_sum`), and `routed_counts` / `kept_counts` the
    assignments per expert before and after dropping. Expert parallelism
    (parallel/moe/expert_parallel.py) keeps the routing and overrides `run_experts` only.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.d_model, config.moe_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.moe_experts))
        self.aux_loss_sum: torch.Tensor | None = None
        self.routed_counts: torch.Tensor | None = None
        self.kept_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        config = self.config
        capacity = expert_capacity(s, config.moe_top_k, config.moe_experts, config.moe_capacity_factor)
        # The router in fp32 even under bf16 autocast (Switch §2.4, "selective precision"): its
        # logits decide discrete choices, and bf16's 8 bits of mantissa would make near-ties common.
        with torch.autocast(x.device.type, enabled=False):
            logits = self.router(x.float())
        routing = route(logits, config.moe_top_k, capacity)
        self.aux_loss_sum = config.moe_aux_weight * routing.aux_sum
        self.routed_counts, self.kept_counts = routing.routed, routing.counts
        rows = x.reshape(b * s, h).index_select(0, routing.token)
        return combine(self.run_experts(rows, routing.counts), routing, b * s).view(b, s, h)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(A, h) rows sorted by expert, `counts[e]` of them for expert e -> the experts' outputs."""
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts, rows.split(counts.tolist()))])


class Block(nn.Module):
    def __init__(self, config: GPTConfig, moe: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MoEMLP(config) if moe else MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


def sequence_positions(length: int, device) -> torch.Tensor:
    """The positions of a whole sequence of `length` tokens: 0, 1, ..., length - 1."""
    return torch.arange(length, device=device)


class Embedding(nn.Module):
    """Token plus learned position embedding.

    `positions(length, device)` gives the global positions of the `length` tokens this rank holds:
    the whole sequence here; context parallelism (parallel/cp/transform.py) sets it to its rank's
    chunks, on this embedding and on tensor parallelism's alike, without either knowing the other.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.positions = sequence_positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(idx) + self.pos(self.positions(idx.shape[1], idx.device)))


class Head(nn.Module):
    """Final LayerNorm and the untied LM head (no bias, as in GPT-2)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model)
        self.out = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config, moe=config.is_moe_block(i)) for i in range(config.n_layers))
        self.head = Head(config)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 initialization from a private generator.

        A private generator (not the global RNG) makes the weights a function of the seed alone,
        identical on every rank whatever else has drawn random numbers before.
        """
        gen = torch.Generator().manual_seed(seed)
        # Residual projections are scaled down by sqrt(2 * layers) so the residual stream's
        # variance does not grow with depth (GPT-2 paper, section 2.3).
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(".proj") else 0.02
                # Draw on the CPU and copy, so a model built on a GPU gets the same numbers.
                module.weight.copy_(torch.empty(module.weight.shape).normal_(0.0, std, generator=gen))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, padded vocab)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy over every token.

    Strategies divide by the number of tokens in the *global* batch themselves, so that the loss
    and its gradient mean the same thing whatever the split into ranks and microbatches.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")


def part_names(n_layers: int) -> list[str]:
    """The GPT's parts in forward order: `embed`, `blocks.0` ... `blocks.{L-1}`, `head`.

    A part is the unit the strategies cut, shard and tag by: a pipeline stage holds whole parts,
    ZeRO keeps one flat buffer per part, FSDP2 wraps each Block, and gradients are tagged
    `grads/<part>`. algebra.part_parameter_counts gives each part's size in closed form.
    """
    return ["embed", *(f"blocks.{i}" for i in range(n_layers)), "head"]


def part_of(param_name: str) -> str:
    """The part a parameter belongs to: `blocks.3.attn.q.weight` -> `blocks.3`, `embed.tok.weight` -> `embed`."""
    parts = param_name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def moe_aux_loss_sum(model: nn.Module) -> torch.Tensor | None:
    """The weighted balancing loss of the last forward of every MoE block in `model` (a whole GPT,
    a wrapped one, or a pipeline stage's chunk), as a sum over tokens; None without MoE blocks.

    Read it right after the forward that produced it: the next forward overwrites it.
    """
    terms = [m.aux_loss_sum for m in model.modules() if isinstance(m, MoEMLP) and m.aux_loss_sum is not None]
    return torch.stack(terms).sum() if terms else None


def training_loss_sum(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`token_loss_sum` plus the MoE balancing loss of the forward that produced `logits`.

    Both are sums over the tokens of this microbatch: divided by the global batch's token count
    they give mean cross-entropy + α · mean over sequences of Σ_MoE blocks aux, and they add up
    over ranks and microbatches (docs/theory/experts.md). For a dense model it is exactly
    `token_loss_sum`.
    """
    loss = token_loss_sum(logits, targets)
    aux = moe_aux_loss_sum(model)
    return loss if aux is None else loss + aux


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
