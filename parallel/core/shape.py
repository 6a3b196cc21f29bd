"""The planner's description of a model: the sandbox GPT's fields, and the few shape choices of
larger models that change memory and FLOPs.

A `ModelShape` is read from a conf/model/ preset. Its GPT fields (layers, width, heads, vocabulary,
sequence, MLP ratio) are the sandbox GPT's own (`parallel.core.model.GPTConfig`); the optional
planner fields describe what the sandbox GPT does not have:

    n_kv_heads            grouped-query attention: K and V have n_kv_heads heads (GPT: n_heads)
    ffn_hidden            the MLP's width (GPT: mlp_ratio · d_model)
    gated_mlp             SwiGLU: gate and up projections, silu(gate)·up, then down (GPT: GELU, fc and proj)
    tied_head             the LM head reuses the token table (GPT: an untied head)
    position_embedding    "learned" table of seq_len rows (GPT) or "rope" (no parameters)
    norm                  "layernorm" (weight and bias, GPT) or "rmsnorm" (weight only)
    bias                  biases on the linears (GPT: yes; Llama: none)

A preset that leaves them all at the GPT's values is a trainable model (`trainable`): its
`gpt_config()` is exactly what launch.train builds, so every closed form (parallel/algebra.py, the families' theory.py)
and the registry applies to it unchanged. A preset that sets any of them is a shape the
planner plans but the sandbox cannot train; `gpt_config()` is then its *carrier*: the GPT with the
same layers, width, heads, vocabulary and sequence, whose traffic and layout rules the planner
uses (see parallel/planner/traffic.py for how the parameter-dependent bytes are scaled).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.core.model import MOE_FIELDS, GPTConfig

GPT_FIELDS = ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "mlp_ratio", "dropout", "vocab_pad_multiple",
              *MOE_FIELDS)
# Planner fields and the value the sandbox GPT has for each.
PLANNER_DEFAULTS = {"n_kv_heads": None, "ffn_hidden": None, "gated_mlp": False, "tied_head": False,
                    "position_embedding": "learned", "norm": "layernorm", "bias": True}


class ShapeError(ValueError):
    """A model preset the planner cannot read; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelShape:
    gpt: GPTConfig  # the GPT fields (the carrier, for a planner-only shape)
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    tied_head: bool = False
    position_embedding: str = "learned"
    norm: str = "layernorm"
    bias: bool = True

    def __post_init__(self):
        if self.position_embedding not in ("learned", "rope"):
            raise ShapeError(f"model.position_embedding={self.position_embedding!r}: choose learned or rope")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ShapeError(f"model.norm={self.norm!r}: choose layernorm or rmsnorm")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.gpt.n_heads % self.n_kv_heads):
            raise ShapeError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.gpt.n_heads} "
                             "(each group of n_heads / n_kv_heads query heads shares one K and V head)")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ShapeError(f"model.ffn_hidden={self.ffn_hidden} must be a positive integer")

    @classmethod
    def from_preset(cls, model: dict) -> ModelShape:
        """A conf/model/ preset (as a plain dict): GPT fields into the carrier, the rest planner fields."""
        unknown = set(model) - set(GPT_FIELDS) - set(PLANNER_DEFAULTS)
        if unknown:
            raise ShapeError(f"model preset has fields no one reads: {', '.join(sorted(unknown))} "
                             f"(GPT fields: {', '.join(GPT_FIELDS)}; planner fields: {', '.join(PLANNER_DEFAULTS)})")
        try:
            gpt = GPTConfig(**{k: model[k] for k in GPT_FIELDS if k in model})
        except ValueError as e:
            raise ShapeError(str(e)) from None
        return cls(gpt=gpt, **{k: model[k] for k in PLANNER_DEFAULTS if k in model})

    # -- what the sandbox GPT can train --------------------------------------------------------------
    @property
    def trainable(self) -> bool:
        """Every planner field at the GPT's value: launch.train builds exactly this model."""
        return all(_same(getattr(self, k), v, k, self) for k, v in PLANNER_DEFAULTS.items())

    def differences(self) -> list[str]:
        """Where this shape differs from the sandbox GPT, in words (empty for a trainable one)."""
        out = []
        if self.kv_heads != self.gpt.n_heads:
            out.append(f"grouped-query attention ({self.kv_heads} K/V heads for {self.gpt.n_heads} query heads)")
        if self.gated_mlp:
            out.append(f"gated (SwiGLU) MLP of width {self.ffn}")
        elif self.ffn != self.gpt.d_ff:
            out.append(f"MLP width {self.ffn} (not {self.gpt.mlp_ratio} x d_model)")
        if self.tied_head:
            out.append("head tied to the token table")
        if self.position_embedding != "learned":
            out.append("rotary positions (no position table)")
        if self.norm != "layernorm":
            out.append("RMSNorm")
        if not self.bias:
            out.append("no biases on the linears")
        return out

    def gpt_config(self) -> GPTConfig:
        return self.gpt

    # -- dimensions ---------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.gpt.n_heads

    @property
    def kv_width(self) -> int:
        """h_kv: the width of K (and of V), kv heads times the head size."""
        return self.kv_heads * self.gpt.head_dim

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or self.gpt.d_ff

    @property
    def norm_parameters(self) -> int:
        return 2 * self.gpt.d_model if self.norm == "layernorm" else self.gpt.d_model

    # -- parameters ---------------------------------------------------------------------------------
    def layer_parameters(self, t: int = 1) -> int:
        """One transformer block on one of t tensor-parallel ranks (t = 1: the whole block):

            2 norms (replicated)  +  Q (h·h + h)/t  +  K, V 2·(h·h_kv + h_kv)/t  +  out proj h·h/t + h
            + MLP  gated: 2·(h·f + f)/t (gate, up) + f·h/t + h (down)   plain: (h·f + f)/t + f·h/t + h

        biases only where `bias` (the row-parallel biases, added after the sum, are whole on every
        rank). For the GPT's fields this is algebra.tp_shard_parameter_count's per-layer term.
        """
        h, hkv, f, nb = self.gpt.d_model, self.kv_width, self.ffn, int(self.bias)
        attention = (h * h + nb * h) // t + 2 * (h * hkv + nb * hkv) // t + h * h // t + nb * h
        up = (2 if self.gated_mlp else 1) * (h * f + nb * f) // t
        return 2 * self.norm_parameters + attention + up + f * h // t + nb * h

    def embedding_parameters(self, t: int = 1) -> int:
        """Token rows V·h/t (vocab-parallel) and the learned position table s·h (replicated)."""
        g = self.gpt
        positions = g.seq_len * g.d_model if self.position_embedding == "learned" else 0
        return g.padded_vocab_size * g.d_model // t + positions

    def head_parameters(self, t: int = 1, copy_of_tied: bool = False) -> int:
        """Final norm, and the head's V·h/t rows unless tied (a pipeline's last stage then keeps a copy
        of the token table, as Megatron does: `copy_of_tied`)."""
        rows = self.gpt.padded_vocab_size * self.gpt.d_model // t
        return self.norm_parameters + (rows if (not self.tied_head or copy_of_tied) else 0)

    def parameter_count(self) -> int:
        """Ψ: equal to algebra.parameter_count for a trainable (dense) shape."""
        return self.embedding_parameters() + self.gpt.n_layers * self.layer_parameters() + self.head_parameters()

    def stage_parameters(self, t: int, layers: int, first: bool, last: bool, stages: int = 1) -> int:
        """What one rank of a pipeline stage holds (compose.theory.stage_shard_parameter_count for the GPT):
        its blocks, the embedding on the first stage, the final norm and head on the last (with a
        tied head and several stages, the last stage's copy of the token rows)."""
        return (layers * self.layer_parameters(t) + (self.embedding_parameters(t) if first else 0)
                + (self.head_parameters(t, copy_of_tied=stages > 1) if last else 0))

    def matmul_parameters(self) -> int:
        """N of the MFU convention (parallel/report/mfu.py): every parameter a token multiplies by, the
        token and position tables left out; a tied head is a matmul, so it counts its V·h once."""
        g = self.gpt
        head = self.head_parameters() + (g.padded_vocab_size * g.d_model if self.tied_head else 0)
        return g.n_layers * self.layer_parameters() + head

    def flops_per_token(self) -> int:
        """Training FLOPs per token, 6·N + 12·L·h·s (PaLM appendix B; parallel/report/mfu.py): Q·Kᵀ and
        softmax·V are 2·s·h each per token and layer forward whatever the number of K/V heads."""
        g = self.gpt
        return 6 * self.matmul_parameters() + 12 * g.n_layers * g.d_model * g.seq_len


def _same(value, default, name: str, shape: ModelShape) -> bool:
    if name == "n_kv_heads":
        return value is None or value == shape.gpt.n_heads
    if name == "ffn_hidden":
        return value is None or value == shape.gpt.d_ff
    return value == default


def untrainable_reason(model: dict) -> str | None:
    """Why launch.train cannot build this preset (planner fields the sandbox GPT does not have), or None."""
    if not any(k in model for k in PLANNER_DEFAULTS):
        return None
    shape = ModelShape.from_preset(model)
    if shape.trainable:
        return None
    return (f"this model preset is a planner shape the sandbox GPT cannot train ({'; '.join(shape.differences())}): "
            "plan it with `python -m launch.plan model=...`, or train a preset without those fields")
