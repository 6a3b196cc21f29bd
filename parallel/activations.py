"""Bytes saved for backward, in closed form: what autograd keeps of this GPT's ops per rank at the
step's peak, for any cut (docs/theory/memory.md, docs/theory/planner.md derive each term).

Counted the way parallel/report/activations.py measures them (distinct storages, at the step's
peak, parameters left out), and like every theory file derived from the shape alone, independent
of the model's tensors and of the measurement it is checked against.
"""

from __future__ import annotations

from parallel.algebra import FP32_BYTES, ID_BYTES
from parallel.core.model import GPTConfig
from parallel.layout import Layout


def _attention_saved(cfg: GPTConfig, tokens: int, seq_len: int, kind: str) -> dict[str, int]:
    """Bytes one attention (fp32) saves for backward on `tokens` = T = b·(s/cp) tokens of a rank:

      qkv          what holds q, k, v: views of the three projections' outputs (sdpa, ring), or the
                   gathered q, k, v of the all-to-all (a2a: the projections' outputs are not kept), 3·T·h
      proj_input   the output projection's input, T·h: the core's output buffer itself (sdpa and
                   ring lay it out (b, s, a, d), so merging the heads is a view), or its copy (a2a)
      core_only    what only the core saves: the lse, T·a (sdpa, ring); the inner SDPA's output
                   and lse, T·(h + a), and the two int64 index tensors (2·s) that put the gathered
                   sequence in position order and back (a2a)
      recomputed   what the core saves when it runs again in backward under selective
                   recomputation: a new output and lse, T·(h + a), plus the gathered q, k, v (a2a)
    """
    h, a, B = cfg.d_model, cfg.n_heads, FP32_BYTES
    out_lse = tokens * (h + a) * B
    if kind == "a2a":
        core_only = out_lse + 2 * seq_len * ID_BYTES
        return {"qkv": 3 * tokens * h * B, "proj_input": tokens * h * B, "core_only": core_only,
                "recomputed": core_only + 3 * tokens * h * B}
    return {"qkv": 3 * tokens * h * B, "proj_input": tokens * h * B, "core_only": tokens * a * B, "recomputed": out_lse}


def activation_terms(cfg: GPTConfig, layout: Layout) -> dict | None:
    """The bytes saved for backward per rank, term by term, at the step's peak (docs/theory/memory.md).

    For this GPT's ops in fp32 without dropout, T = b·(s/cp) tokens of one microbatch on a rank,
    h, f = mlp_ratio·h, a heads, V the padded vocabulary, G = dp·m·b sequences in the global batch:

      embedding   the token ids (a view of the step's global batch: its storage, G·s int64; under
                  cp the rank's own copy, b·(s/cp)) and the positions (s/cp int64)
      each block  LayerNorms 2·(input + output + mean + rstd) = T·(4h + 4), q, k, v and the
                  attention core (`_attention_saved`), fc output and GELU output 2·T·f
      head        final LayerNorm T·(2h + 2), log-softmax T·V, the targets (as the ids), nll's
                  total weight (4 bytes)

    Peak per mode, L blocks: none E + L·layer + H; selective: each block's core keeps only its
    inputs (the larger of the forward's end and the last core's recomputation in backward); full:
    E + L·T·h + max(H, layer − T·h): only each block's input is kept, and after the head's backward
    the last block is recomputed whole (its input already counted). None where the model or layout
    is outside what is derived (dropout, experts, bf16, tensor or pipeline parallelism).
    """
    dims = layout.dims
    if cfg.dropout or cfg.moe_experts or layout.precision != "fp32" or dims.tp > 1 or dims.pp > 1:
        return None
    h, f, V, B, L = cfg.d_model, cfg.d_ff, cfg.padded_vocab_size, FP32_BYTES, cfg.n_layers
    b, cp = layout.microbatch_size, dims.cp
    s = cfg.seq_len // cp
    tokens = b * s
    ids = b * s * ID_BYTES if cp > 1 else dims.dp * layout.microbatches * b * cfg.seq_len * ID_BYTES
    attention = _attention_saved(cfg, tokens, cfg.seq_len, layout.cp_kind if cp > 1 else "sdpa")
    norms, mlp, block_input = tokens * (4 * h + 4) * B, 2 * tokens * f * B, tokens * h * B
    layer = norms + attention["qkv"] + attention["proj_input"] + attention["core_only"] + mlp
    embedding = ids + s * ID_BYTES
    head = tokens * (2 * h + 2 + V) * B + ids + FP32_BYTES
    if layout.recompute == "none":
        peak = embedding + L * layer + head
    elif layout.recompute == "selective":
        kept = layer - attention["core_only"]
        # In backward, the last block's core runs again while its first norm and q, k, v are still held.
        last_core = (L - 1) * kept + tokens * (2 * h + 2) * B + attention["qkv"] + attention["recomputed"]
        peak = embedding + max(L * kept + head, last_core)
    else:
        peak = embedding + L * block_input + max(head, layer - block_input)
    return {"embedding": embedding, "layer": layer, "head": head, "peak": peak}


def activation_bytes(cfg: GPTConfig, layout: Layout) -> list[int] | None:
    """The registry's `activations` formula for single, dp, zero1/2, cp and cp_a2a: every rank
    holds the same, `activation_terms(...)["peak"]`."""
    terms = activation_terms(cfg, layout)
    return None if terms is None else [terms["peak"]] * layout.dims.world_size
