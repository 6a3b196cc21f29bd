"""Context parallelism's closed forms: the bytes one cp rank's attention sends, per layer and
microbatch, then per step with the gradient sum over dp x cp, and the model state each rank holds.

Notation (docs/theory/context.md): b microbatch size, s full sequence length, a the query heads
this rank's attention holds (n_heads, or n_heads / tp under tensor parallelism), a_kv its K/V heads
(n_kv_heads, over tp: split or one replicated; a_kv = a without grouped-query attention), d head
dim, cp the context-parallel degree, B bytes per activation element (4 in fp32, 2 under bf16
autocast). A rank holds s/cp tokens, so its Q is b·a·(s/cp)·d elements and its K (or V) b·a_kv·(s/cp)·d.

Ring (parallel/cp/ring.py), `send` calls on the cp group (K and V travel unexpanded):
    forward   cp − 1 sends of K and V:                           (cp − 1)·2·b·a_kv·(s/cp)·d·B
    backward  cp − 1 sends of K and V, cp − 1 of the dK, dV      (cp − 1)·2·b·a_kv·(s/cp)·d·(B + max(B, 4))
              accumulator (fp32, or wider activations' dtype)
All-to-all (parallel/cp/ulysses.py), `all_to_all` calls, each sending (cp − 1)/cp of its input:
    forward   Q, K, V packed (a + 2a' heads), the output (a)      (cp − 1)/cp·b·(2a + 2a')·(s/cp)·d·B
    backward  the same two, reversed                              (cp − 1)/cp·b·(2a + 2a')·(s/cp)·d·B
    with a' = a_kv where cp divides a_kv, else cp (each kv head replicated cp/a_kv times)
Every figure is what the communication log's `sent` column adds up to, to the byte; like every
theory file, it is derived from the shape alone, independent of the code and the log it checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from parallel.algebra import (
    FP32_BYTES,
    all_ranks,
    all_reduce_sent_per_rank,
    figure,
    gather_or_scatter_sent_per_rank,
    kv_heads_in_all_to_all,
    parameter_count,
    replica_group_size,
    zero_padded_parameter_count,
)
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.cp.layout import check_divisible
from parallel.cp.options import CPOptions
from parallel.layout import Layout
from parallel.model_state import model_state, run_state_bytes, whole_model_parts
from parallel.sync.options import SyncOptions


@dataclass(frozen=True)
class LayerTraffic:
    """One attention layer, one microbatch, one rank: calls that send and the bytes they send."""

    op: str  # "send" (ring) or "all_to_all"
    fwd_calls: int
    fwd_sent: Fraction
    bwd_calls: int
    bwd_sent: Fraction

    @property
    def sent(self) -> Fraction:
        return self.fwd_sent + self.bwd_sent


def local_kv_elements(batch: int, seq_len: int, heads: int, head_dim: int, cp: int) -> int:
    """Elements of one of K or V on one rank: b·a·(s/cp)·d."""
    check_divisible(seq_len, cp)
    return batch * heads * (seq_len // cp) * head_dim


def ring_layer_traffic(batch: int, seq_len: int, kv_heads: int, head_dim: int, cp: int,
                       dtype_bytes: int) -> LayerTraffic:
    """The ring sends K and V only, with their own (kv) heads."""
    kv = 2 * local_kv_elements(batch, seq_len, kv_heads, head_dim, cp)  # K and V travel together
    hops = cp - 1
    return LayerTraffic(
        op="send",
        fwd_calls=hops, fwd_sent=Fraction(hops * kv * dtype_bytes),
        bwd_calls=2 * hops, # the ring's gradient accumulator is never narrower than fp32
        bwd_sent=Fraction(hops * kv * (dtype_bytes + max(dtype_bytes, FP32_BYTES))),
    )


def ulysses_payload(batch: int, seq_len: int, heads: int, head_dim: int, cp: int, dtype_bytes: int,
                    kv_heads: int | None = None) -> int:
    """Bytes into the all-to-alls of one direction: q, k, v (a + 2a' heads) and the output (a)."""
    kv = kv_heads_in_all_to_all(heads if kv_heads is None else kv_heads, cp)
    return local_kv_elements(batch, seq_len, 2 * heads + 2 * kv, head_dim, cp) * dtype_bytes


def ulysses_layer_traffic(batch: int, seq_len: int, heads: int, head_dim: int, cp: int,
                          dtype_bytes: int, kv_heads: int | None = None) -> LayerTraffic:
    units = ulysses_payload(batch, seq_len, heads, head_dim, cp, dtype_bytes, kv_heads)
    per_direction = Fraction(cp - 1, cp) * units  # 0 for a group of one, whose two calls move nothing
    return LayerTraffic(op="all_to_all", fwd_calls=2, fwd_sent=per_direction, bwd_calls=2, bwd_sent=per_direction)


def step_sent(layer: LayerTraffic, n_layers: int, microbatches: int) -> Fraction:
    """Bytes one cp rank sends for attention in one optimizer step: every layer, every microbatch,
    forward and backward (the cp group's only traffic; gradient sync over cp is the dp's business)."""
    return layer.sent * n_layers * microbatches


# -- per step (docs/theory/context.md) ----------------------------------------------------------------
def activation_dtype_bytes(layout: Layout) -> int:
    """Bytes of the activations inside a block (q, k, v, attention outputs): 2 under bf16 autocast."""
    return 2 if layout.precision == "bf16" else layout.dtype_bytes


def cp_attention_traffic(model: GPTConfig, layout: Layout, layers: int) -> dict[str, tuple[int, Fraction]]:
    """What one rank's attention sends across its cp group per step, over `layers` blocks:
    {op: (payload bytes, sent bytes)}, empty without context parallelism.

    Per layer and microbatch (the functions above, docs/theory/context.md §2-3), with
    u = b·(s/cp)·d the elements of one head on this rank, a = n_heads/t its query heads and a_kv its
    K/V heads (ModelShape.kv_heads_per_rank(t)):

      ring   forward (cp−1)·2·a_kv·u·B, backward (cp−1)·2·a_kv·u·(B + max(B, 4)): `send` calls (their
             `recv` twins carry the same payload and send nothing)
      a2a    forward and backward (cp−1)/cp·(2a + 2a')·u·B each: `all_to_all` calls, payload
             (2a + 2a')·u·B each way (a' = a_kv, or cp where the kv heads are replicated)

    Recomputation (selective or full) runs the core's forward once more inside backward, its
    sends with it: the forward's bytes count twice.
    """
    dims = layout.dims
    if dims.cp == 1:
        return {}
    b, m, B = layout.microbatch_size, layout.microbatches, activation_dtype_bytes(layout)
    heads, forwards = model.n_heads // dims.tp, 2 if layout.recompute != "none" else 1
    kv_heads = ModelShape(gpt=model).kv_heads_per_rank(dims.tp)
    if layout.of(CPOptions).kind == "ring":
        traffic = ring_layer_traffic(b, model.seq_len, kv_heads, model.head_dim, dims.cp, B)
    else:
        traffic = ulysses_layer_traffic(b, model.seq_len, heads, model.head_dim, dims.cp, B, kv_heads)
    sent = layers * m * (forwards * traffic.fwd_sent + traffic.bwd_sent)
    if traffic.op == "send":
        return {"send": (int(sent), sent), "recv": (int(sent), Fraction(0))}
    per_direction = ulysses_payload(b, model.seq_len, heads, model.head_dim, dims.cp, B, kv_heads)
    return {"all_to_all": (layers * m * (forwards + 1) * per_direction, sent)}


def cp_comm(model: GPTConfig, layout: Layout) -> dict:
    """cp and cp_a2a (dp x cp, one stage, no tp): per step, every rank sends

      cp      its attention's bytes over all L layers (`cp_attention_traffic`), and
      dp_cp   its gradients summed over the n = dp·cp ranks that replicate every parameter:
              one all-reduce, 2(n−1)/n·Ψ·B; or ZeRO over those n ranks on Ψ_pad(n)·B bytes
              (G reduce-scattered once per step, or per microbatch under ZeRO-2, P all-gathered):
              (n−1)/n·(G + P) or (n−1)/n·(m·G + P), as parallel/zero/theory.py's `zero_comm` with N = n.
    """
    dims, B, m = layout.dims, layout.dtype_bytes, layout.microbatches
    n, ranks = replica_group_size(dims), dims.world_size
    attention = cp_attention_traffic(model, layout, model.n_layers)
    zero = layout.of(SyncOptions).zero
    if zero:
        size = zero_padded_parameter_count(model, n) * B
        grads = {"all_gather": size, "reduce_scatter": (m if zero == 2 else 1) * size}
        grad_ops = {op: (payload, gather_or_scatter_sent_per_rank(n, payload)) for op, payload in grads.items()}
    else:
        grads_bytes = parameter_count(model) * B
        grad_ops = {"all_reduce": (grads_bytes, all_reduce_sent_per_rank(n, grads_bytes))}
    groups = {"cp": sum((sent for _, sent in attention.values()), Fraction(0)) * ranks,
              "dp_cp": sum((sent for _, sent in grad_ops.values()), Fraction(0)) * ranks}
    return figure(all_ranks({**attention, **grad_ops}, ranks), ranks, groups)


def cp_model_state_bytes(model: GPTConfig, layout: Layout) -> dict:
    """Every rank holds the whole model (16Ψ bytes in fp32 with Adam); with ZeRO-1/2 over the
    n = dp·cp ranks, on the padded Ψ_pad(n): 1/n of Adam's state, and under ZeRO-2 of the gradients
    (parallel/zero/theory.py's `zero_model_state_bytes` with N = n): every part, sharded over dp·cp."""
    return model_state(whole_model_parts(ModelShape(gpt=model)), run_state_bytes(layout.dtype_bytes),
                       layout.of(SyncOptions).zero,
                       replica_group_size(layout.dims))
