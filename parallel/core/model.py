"""The one model every strategy trains.

A decoder-only transformer, GPT-2 shaped by default: learned token and position embeddings,
pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and an
untied LM head. The same classes build Llama's block from the fields of parallel/core/config.py:
grouped-query attention, a SwiGLU MLP, RMSNorm, rotary positions (parallel/core/rotary.py), no
biases. There is no distributed code here: the parallel strategies take this model, built
identically on every rank from one seed, and transform it (shard, split, wrap).

The model is split into three parts so that a pipeline can cut it later without rewriting it:
`embed` (tokens -> hidden), `blocks` (hidden -> hidden) and `head` (hidden -> logits).

With `moe_experts` > 0 some blocks replace their MLP by a mixture of experts (`MoEMLP`: a router
and `moe_experts` MLPs of the dense shape; routing in parallel/core/routing.py, the theory in
docs/theory/experts.md). With the default `moe_experts=0` the model is dense.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.core.config import MOE_FIELDS as MOE_FIELDS  # re-exported: where the model's fields are read
from parallel.core.config import GPTConfig
from parallel.core.norm import RMSNorm
from parallel.core.positions import sequence_positions
from parallel.core.rotary import Rotary
from parallel.core.routing import combine, expert_capacity, route


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
        # k and v may have fewer heads than q (grouped-query attention): each serves q's heads / k's
        # heads consecutive query heads.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=k.shape[1] != q.shape[1])


class CausalSelfAttention(nn.Module):
    """Q, K, V projections, rotary positions where the model has them, the core, the output projection.

    With grouped-query attention K and V have `n_kv_heads` heads of the query's size; the core
    receives them unexpanded, so nothing stores or sends a copy per query head.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        # Separate Q, K and V projections (not one fused qkv matrix) so that tensor parallelism can
        # cut each along its heads without reshuffling a fused weight.
        self.q = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.k = nn.Linear(config.d_model, config.kv_width, bias=config.bias)
        self.v = nn.Linear(config.d_model, config.kv_width, bias=config.bias)
        self.rotary = Rotary(config.head_dim, config.rope_base) if config.rope else None
        self.core = AttentionCore(config.dropout)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads are read off the projection's own output width, so a shard that holds only some
        # heads (tensor parallelism) runs this same code.
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GPT-2's proj(gelu(fc(x))), or with `gated_mlp` SwiGLU's proj(silu(gate(x)) · fc(x)) (Shazeer
    2020; Llama's w1 is `gate`, w3 `fc`, w2 `proj`)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias) if config.gated_mlp else None
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.proj(F.gelu(self.fc(x)))
        return self.proj(F.silu(self.gate(x)) * self.fc(x))


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
        self.ln1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln2 = make_norm(config)
        self.mlp = MoEMLP(config) if moe else MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


def make_norm(config: GPTConfig) -> nn.Module:
    """LayerNorm (x - mean)/std · w + b, or RMSNorm x/rms(x) · w (Zhang & Sennrich 2019: no centring,
    no bias), both with Llama's and GPT-2's eps of 1e-5. The RMSNorm is parallel/core/norm.py's: torch's
    numbers, saving for backward only its input and 1/rms, as fused kernels do."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=1e-5)
    return nn.LayerNorm(config.d_model)


class Embedding(nn.Module):
    """Token plus learned position embedding (the token embedding alone under rotary positions,
    which the attention applies).

    `positions(length, device)` gives the global positions of the `length` tokens this rank holds:
    the whole sequence here; context parallelism (parallel/cp/transform.py) sets it to its rank's
    chunks, on this embedding and on tensor parallelism's alike, without either knowing the other.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model) if not config.rope else None
        self.drop = nn.Dropout(config.dropout)
        self.positions = sequence_positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.pos is None:
            return self.drop(self.tok(idx))
        return self.drop(self.tok(idx) + self.pos(self.positions(idx.shape[1], idx.device)))


class Head(nn.Module):
    """Final norm and the LM head (no bias, as in GPT-2 and Llama; tied to the token table where
    `tied_head`: GPT.__init__ ties it)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = make_norm(config)
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
        if config.tied_head:
            # One Parameter in two modules: model.parameters() lists it once, as embed.tok.weight.
            self.head.out.weight = self.embed.tok.weight
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
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif name == "head.out" and self.config.tied_head:
                continue  # the token table, drawn already
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


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """The state-dict names under which a parameter appears a second time, each with the name it is
    listed under (a tied head: head.out.weight -> embed.tok.weight). model.state_dict() holds both,
    named_parameters() the first only."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            out[name] = first[id(p)]
    return out


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
