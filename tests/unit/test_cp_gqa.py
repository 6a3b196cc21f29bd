"""Context parallelism on grouped-query attention, in one process: the blockwise math, the bytes.

The ring computes attention one (query block, key block) pair at a time with K and V unexpanded
(parallel/cp/blockwise.py: each kv head meets its g query heads by broadcasting); here one pair and
a merge of two key blocks are held to PyTorch's own grouped-query SDPA, forward and backward, in
float64. The closed forms of parallel/cp/theory.py are written out by hand for Llama's shape: the
ring sends a_kv heads of K and V, the all-to-all a + 2a' heads in and a out, with a' the kv heads
or cp replicas of them. The ranks' runs are in tests/layers/test_cp_layers.py and tests/runs/test_cp.py.
"""

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from parallel.core.config import GPTConfig
from parallel.cp.blockwise import block_backward, block_forward, merge
from parallel.cp.layout import validate
from parallel.cp.theory import cp_attention_traffic, ring_layer_traffic, ulysses_layer_traffic
from parallel.dist.dims import ParallelDims
from parallel.registry import layout_of

B, HEADS, KV_HEADS, N, D = 2, 4, 2, 6, 8
SCALE = D ** -0.5


def _tensors(seed: int, key_tokens: int = N):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, N, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, KV_HEADS, key_tokens, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(B, HEADS, N, D, generator=gen, dtype=torch.float64)


def _reference(q, k, v, dout, causal: bool):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), *(t.grad for t in leaves)


def _grouped(x):
    return x.unflatten(1, (KV_HEADS, -1))


@pytest.mark.parametrize("causal", [True, False], ids=["diagonal", "full"])
def test_one_block_with_unexpanded_kv_equals_grouped_query_sdpa(causal):
    q, k, v, dout = _tensors(0)
    out, lse = block_forward(_grouped(q), k, v, causal, SCALE)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, causal)
    torch.testing.assert_close(out.flatten(1, 2), ref_out, rtol=1e-12, atol=1e-12)
    delta = (_grouped(dout) * out).sum(-1)
    dq, dk, dv = block_backward(_grouped(q), k, v, _grouped(dout), lse, delta, causal, SCALE)
    assert dk.shape == dv.shape == k.shape  # each kv head's gradient, summed over its query heads
    for mine, ref in ((dq.flatten(1, 2), ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)


def test_two_key_blocks_merged_equal_attention_over_both():
    """A query chunk after one full key chunk and on its own diagonal: the ring's step pattern."""
    q, k, v, dout = _tensors(1, key_tokens=2 * N)
    early, diagonal = (block_forward(_grouped(q), k[:, :, part], v[:, :, part], causal, SCALE)
                       for part, causal in ((slice(0, N), False), (slice(N, 2 * N), True)))
    out, lse = merge(*early, *diagonal)
    # The reference: the same queries at positions N..2N−1 of a 2N-token causal sequence.
    mask = torch.ones(N, 2 * N, dtype=torch.bool).tril(N)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.flatten(1, 2), ref, rtol=1e-12, atol=1e-12)
    delta = (_grouped(dout) * out).sum(-1)
    grads = [block_backward(_grouped(q), k[:, :, part], v[:, :, part], _grouped(dout), lse, delta, causal, SCALE)
             for part, causal in ((slice(0, N), False), (slice(N, 2 * N), True))]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True).backward(dout)
    torch.testing.assert_close((grads[0][0] + grads[1][0]).flatten(1, 2), leaves[0].grad, rtol=1e-12, atol=1e-12)
    for i in (1, 2):
        torch.testing.assert_close(torch.cat([grads[0][i], grads[1][i]], dim=2), leaves[i].grad, rtol=1e-12,
                                   atol=1e-12)


def test_closed_forms_for_fewer_kv_heads_by_hand():
    # b 2, s 32, d 8, cp 2: a head on a rank is 2·16·8 = 256 elements.
    ring = ring_layer_traffic(2, 32, 2, 8, 2, 4)  # 2 kv heads travel, not the 4 query heads
    assert (ring.fwd_sent, ring.bwd_sent) == (1 * 2 * 2 * 256 * 4, 1 * 2 * 2 * 256 * 8)
    a2a = ulysses_layer_traffic(2, 32, 4, 8, 2, 4, kv_heads=2)  # q, k, v: 4 + 2 + 2 heads in, 4 out
    assert a2a.fwd_sent == a2a.bwd_sent == Fraction(1, 2) * (8 + 4) * 256 * 4
    # cp 4 with 2 kv heads: each rank gets one replica, so 4 kv heads' worth of K and V go in.
    replicated = ulysses_layer_traffic(2, 32, 4, 8, 4, 4, kv_heads=2)
    assert replicated.fwd_sent == Fraction(3, 4) * (8 + 8) * 128 * 4
    assert ulysses_layer_traffic(2, 32, 4, 8, 4, 4).sent == replicated.sent  # the same bytes as MHA


def test_a_run_sends_the_kv_heads_each_tp_rank_holds():
    """cp x tp: 2 kv heads over tp 2 is one per rank; over tp 4, one replica per rank (ModelShape)."""
    llama = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, gated_mlp=True,
                      norm="rmsnorm", position_embedding="rope", bias=False)
    head = 16 * (32 // 2) * 16  # b 16, s/cp 16, d 16
    for tp in (2, 4):
        layout = layout_of(ParallelDims.resolve(2 * tp, cp=2, tp=tp), microbatch_size=16)
        sends, _ = cp_attention_traffic(llama, layout, 1)["send"]
        assert sends == (1 + 2) * 2 * 1 * head * 4  # forward, then backward with its fp32 accumulator


def test_the_all_to_all_refuses_kv_heads_cp_neither_divides_nor_multiplies():
    validate("a2a", 2, 32, 4, kv_heads=2)  # cp divides the kv heads
    validate("a2a", 4, 32, 4, kv_heads=2)  # cp a multiple of them: replicated
    validate("ring", 2, 36, 6, kv_heads=3)  # the ring cuts the sequence only
    with pytest.raises(ValueError, match=r"^parallel.cp=2 neither divides nor is a multiple of the 3 K/V heads per "
                                         r"rank \(model.n_kv_heads over tp\).*use cp in \[1, 3, 6\], or the ring"):
        validate("a2a", 2, 36, 6, kv_heads=3)
