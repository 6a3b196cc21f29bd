"""The model's configuration: every field a conf/model/ preset may set, checked once.

Two block shapes come out of one set of fields. GPT-2's (the default of every field): learned
positions, LayerNorm, multi-head attention, a GELU MLP four times as wide as the model, biases on
every linear. Llama's (conf/model/tiny_llama.yaml, small_llama.yaml, llama3_*.yaml):

    n_kv_heads            grouped-query attention: K and V have n_kv_heads heads, each shared by
                          n_heads / n_kv_heads query heads (None: n_heads, multi-head attention;
                          1: multi-query attention)
    gated_mlp, ffn_hidden SwiGLU: down(silu(gate(x)) · up(x)), gate and up of width ffn_hidden
                          (ungated: proj(gelu(fc(x))), fc of width ffn_hidden or mlp_ratio · d_model)
    norm                  "layernorm" (weight and bias) or "rmsnorm" (weight only)
    position_embedding    "learned" (a table of seq_len rows) or "rope" (rotary, no parameters,
                          with `rope_base` its frequency base)
    bias                  biases on the attention's and the MLP's linears
    tied_head             the LM head reuses the token table

Mixture of experts: `moe_experts` > 0 replaces the MLP of some blocks by experts of the dense
MLP's shape (SwiGLU experts for a gated model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The GPTConfig fields of a mixture of experts, spelled as in conf/model/*.yaml.
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor", "moe_aux_weight")
# The fields of the block's shape beyond GPT-2's, with GPT-2's value of each.
SHAPE_FIELDS = {"n_kv_heads": None, "ffn_hidden": None, "gated_mlp": False, "norm": "layernorm",
                "position_embedding": "learned", "rope_base": 10000.0, "bias": True, "tied_head": False}
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")


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
    # The block's shape (module docstring): GPT-2's by default.
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    norm: str = "layernorm"
    position_embedding: str = "learned"
    rope_base: float = 10000.0
    bias: bool = True
    tied_head: bool = False

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
        self._check_shape()
        self._check_moe()

    def _check_shape(self) -> None:
        for name in ("gated_mlp", "bias", "tied_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be true or false")
        if self.norm not in NORMS:
            raise ValueError(f"model.norm={self.norm!r}: choose one of {', '.join(NORMS)}")
        if self.position_embedding not in POSITIONS:
            raise ValueError(
                f"model.position_embedding={self.position_embedding!r}: choose one of {', '.join(POSITIONS)}")
        kv = self.n_kv_heads
        if kv is not None and (not _is_count(kv) or self.n_heads % kv):
            divisors = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            raise ValueError(
                f"model.n_kv_heads={kv!r} does not divide model.n_heads={self.n_heads}: each K/V head serves "
                f"n_heads / n_kv_heads query heads, so choose one of {divisors} (or null for multi-head attention)")
        if self.ffn_hidden is not None and not _is_count(self.ffn_hidden):
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden!r} must be a positive integer")
        if self.gated_mlp and self.ffn_hidden is None:
            raise ValueError(
                "model.gated_mlp=true needs model.ffn_hidden, the gate's and up projection's width: set it "
                f"(Llama's rule, about 8/3 · d_model rounded up to a multiple of 64: model.ffn_hidden="
                f"{-(-8 * self.d_model // 3 // 64) * 64})")
        if self.rope:
            if self.head_dim % 2:
                raise ValueError(
                    f"model.position_embedding=rope rotates pairs of a head's dimensions, and the head dimension "
                    f"d_model / n_heads = {self.d_model} / {self.n_heads} = {self.head_dim} is odd: "
                    "choose n_heads so that it is even, or position_embedding=learned")
            if not isinstance(self.rope_base, (int, float)) or isinstance(self.rope_base, bool) \
                    or not math.isfinite(self.rope_base) or self.rope_base <= 1:
                raise ValueError(
                    f"model.rope_base={self.rope_base!r} must be a finite number above 1 (Llama 3: 500000)")

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
        """f: the MLP's hidden width (each of gate and up in a gated MLP)."""
        return self.ffn_hidden if self.ffn_hidden is not None else self.mlp_ratio * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """K/V heads: n_kv_heads, or n_heads (multi-head attention)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def kv_width(self) -> int:
        """h_kv: the width of K (and of V), kv heads times the head size."""
        return self.kv_heads * self.head_dim

    @property
    def rope(self) -> bool:
        return self.position_embedding == "rope"

    @property
    def norm_parameters(self) -> int:
        """One norm's parameters: weight and bias (LayerNorm), weight only (RMSNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    @property
    def is_gpt2_shape(self) -> bool:
        """Every shape field at GPT-2's value (the block every strategy was first written for)."""
        return all(getattr(self, k) == v for k, v in SHAPE_FIELDS.items()
                   if k not in ("n_kv_heads", "ffn_hidden", "rope_base")) \
            and self.kv_heads == self.n_heads and self.d_ff == self.mlp_ratio * self.d_model


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, k + 1) if n % d == 0)
