"""A model's shape in the planner's terms: dimensions, parameter counts per rank and FLOPs.

A `ModelShape` is a view of one `GPTConfig` (parallel/core/config.py), the model launch.train
builds from the same conf/model/ preset: GPT-2's block, Llama's (grouped-query attention, a SwiGLU
MLP, RMSNorm, rotary positions, no biases, a tied or untied head) or any mix. Its counts are the
closed forms every family's theory and the planner share; they are checked against the model's
own tensors (tests/unit/test_model_shapes.py) and, through the families' theory, against the runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from parallel.core.config import GPTConfig

# Every field a conf/model/ preset may set.
MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig))


class ShapeError(ValueError):
    """A model preset that cannot be read; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelShape:
    gpt: GPTConfig

    @classmethod
    def from_preset(cls, model: dict) -> ModelShape:
        """A conf/model/ preset (as a plain dict)."""
        unknown = set(model) - set(MODEL_FIELDS)
        if unknown:
            raise ShapeError(f"model preset has fields no one reads: {', '.join(sorted(unknown))} "
                             f"(the model's fields: {', '.join(MODEL_FIELDS)})")
        try:
            return cls(gpt=GPTConfig(**model))
        except (TypeError, ValueError) as e:
            raise ShapeError(str(e)) from None

    # -- the block's shape, read off the config ------------------------------------------------------
    @property
    def gated_mlp(self) -> bool:
        return self.gpt.gated_mlp

    @property
    def tied_head(self) -> bool:
        return self.gpt.tied_head

    @property
    def norm(self) -> str:
        return self.gpt.norm

    @property
    def bias(self) -> bool:
        return self.gpt.bias

    def differences(self) -> list[str]:
        """Where this shape differs from GPT-2's block, in words (empty for GPT-2's)."""
        g, out = self.gpt, []
        if g.kv_heads != g.n_heads:
            out.append(f"grouped-query attention ({g.kv_heads} K/V heads for {g.n_heads} query heads)")
        if g.gated_mlp:
            out.append(f"gated (SwiGLU) MLP of width {g.d_ff}")
        elif g.d_ff != g.mlp_ratio * g.d_model:
            out.append(f"MLP width {g.d_ff} (not {g.mlp_ratio} x d_model)")
        if g.tied_head:
            out.append("head tied to the token table")
        if g.rope:
            out.append("rotary positions (no position table)")
        if g.norm != "layernorm":
            out.append("RMSNorm")
        if not g.bias:
            out.append("no biases on the linears")
        return out

    # -- dimensions ---------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.gpt.kv_heads

    @property
    def kv_width(self) -> int:
        """h_kv: the width of K (and of V), kv heads times the head size."""
        return self.gpt.kv_width

    @property
    def ffn(self) -> int:
        return self.gpt.d_ff

    @property
    def norm_parameters(self) -> int:
        return self.gpt.norm_parameters

    def kv_replicas(self, t: int) -> int:
        """Tp ranks that hold each K/V head, of t: one where t divides the kv heads (each rank holds
        kv/t of them), t/kv where t is a multiple of them (rank r's query heads all read kv head
        r // (t/kv), so it holds that one: Megatron's and vLLM's rule)."""
        kv = self.kv_heads
        return 1 if kv % t == 0 else t // kv

    def kv_heads_per_rank(self, t: int) -> int:
        """K/V heads one of t tp ranks holds: kv/t, or one replicated (`kv_replicas`)."""
        return self.kv_heads * self.kv_replicas(t) // t

    def kv_width_per_rank(self, t: int) -> int:
        """The width of K (and of V) on one of t tp ranks: its kv heads times the head size, h_kv/t
        where t divides the kv heads, one head's where the heads are replicated."""
        return self.kv_heads_per_rank(t) * self.gpt.head_dim

    # -- parameters ---------------------------------------------------------------------------------
    def layer_parameters(self, t: int = 1) -> int:
        """One transformer block on one of t tensor-parallel ranks (t = 1: the whole block):

            2 norms (replicated)  +  Q (h·h + h)/t  +  K, V 2·(h·h_kv,t + h_kv,t)  +  out proj h·h/t + h
            + MLP  gated: 2·(h·f + f)/t (gate, up) + f·h/t + h (down)   plain: (h·f + f)/t + f·h/t + h

        biases only where `bias` (the row-parallel biases, added after the sum, are whole on every
        rank); h_kv,t = h_kv/t, or one head's width where t exceeds the kv heads (`kv_heads_per_rank`).
        """
        h, f, nb = self.gpt.d_model, self.ffn, int(self.bias)
        hkv = self.kv_width_per_rank(t)  # K's (and V's) width on this rank
        attention = (h * h + nb * h) // t + 2 * (h * hkv + nb * hkv) + h * h // t + nb * h
        up = (2 if self.gated_mlp else 1) * (h * f + nb * f) // t
        return 2 * self.norm_parameters + attention + up + f * h // t + nb * h

    def mlp_parameters(self) -> int:
        """One MLP (one expert of an MoE block): gated 2·(h·f + f) + f·h + h, plain (h·f + f) + f·h + h,
        biases only where the shape has them."""
        h, f, nb = self.gpt.d_model, self.ffn, int(self.bias)
        return (2 if self.gated_mlp else 1) * (h * f + nb * f) + f * h + nb * h

    def embedding_parameters(self, t: int = 1) -> int:
        """Token rows V·h/t (vocab-parallel) and the learned position table s·h (replicated)."""
        g = self.gpt
        positions = 0 if g.rope else g.seq_len * g.d_model
        return g.padded_vocab_size * g.d_model // t + positions

    def head_parameters(self, t: int = 1, copy_of_tied: bool = False) -> int:
        """Final norm, and the head's V·h/t rows unless tied (a pipeline's last stage then keeps a copy
        of the token table, as Megatron does: `copy_of_tied`)."""
        rows = self.gpt.padded_vocab_size * self.gpt.d_model // t
        return self.norm_parameters + (rows if (not self.tied_head or copy_of_tied) else 0)

    def parameter_count(self) -> int:
        """Ψ: equal to algebra.parameter_count for a dense shape."""
        return self.embedding_parameters() + self.gpt.n_layers * self.layer_parameters() + self.head_parameters()

    def stage_parameters(self, t: int, layers: int, first: bool, last: bool, stages: int = 1) -> int:
        """What one rank of a pipeline stage holds (compose.theory.stage_shard_parameter_count for the GPT):
        its blocks, the embedding on the first stage, the final norm and head on the last (with a
        tied head and several stages, the last stage's copy of the token rows)."""
        return (layers * self.layer_parameters(t) + (self.embedding_parameters(t) if first else 0)
                + (self.head_parameters(t, copy_of_tied=stages > 1) if last else 0))

    def matmul_parameters(self) -> int:
        """N of the MFU convention (parallel/report/mfu.py): every parameter a token multiplies by, the
        token and position tables left out; a tied head is a matmul, so it counts its V·h once; an MoE
        block its router and the k experts a token goes to."""
        g = self.gpt
        head = self.head_parameters() + (g.padded_vocab_size * g.d_model if self.tied_head else 0)
        # An MoE block: the router's h·E and k experts of the MLP's shape where a dense block has one MLP
        # (the active parameters, algebra.active_parameter_count).
        moe = len(g.moe_blocks) * ((g.moe_top_k - 1) * self.mlp_parameters() + g.d_model * g.moe_experts)
        return g.n_layers * self.layer_parameters() + head + moe

    def flops_per_token(self) -> int:
        """Training FLOPs per token, 6·N + 12·L·h·s (PaLM appendix B; parallel/report/mfu.py): Q·Kᵀ and
        softmax·V are 2·s·h each per token and layer forward whatever the number of K/V heads."""
        g = self.gpt
        return 6 * self.matmul_parameters() + 12 * g.n_layers * g.d_model * g.seq_len
