"""Tensor parallelism's cut of Llama's block (conf/model/tiny_llama.yaml: 4 query heads, 2 K/V heads,
SwiGLU, RMSNorm, RoPE, no biases), on the model itself: what each rank holds is the piece
`TPShards.local_part` names, K and V included where tp 4 holds each kv head on two ranks, and the
shard sizes are the closed form's (`ModelShape.layer_parameters`, through algebra)."""

from types import SimpleNamespace

import pytest
import torch
import yaml
from launcher import PROJECT_ROOT

from parallel.algebra import tp_shard_parameter_count
from parallel.core.config import GPTConfig
from parallel.core.model import GPT, count_parameters
from parallel.core.shape import ModelShape
from parallel.tp.layers import NormIntoTP, parallelize_tp
from parallel.tp.options import TPOptions
from parallel.tp.theory import kv_replica_grad_count

LLAMA = GPTConfig(**yaml.safe_load((PROJECT_ROOT / "conf/model/tiny_llama.yaml").read_text()))


@pytest.mark.parametrize("t", [2, 4])
def test_each_rank_holds_the_piece_local_part_names(t):
    full = dict(GPT(LLAMA, seed=0).named_parameters())
    for rank in range(t):
        model = GPT(LLAMA, seed=0)
        # parallelize_tp only reads the rank and size while cutting; no collective runs.
        shards = parallelize_tp(model, SimpleNamespace(rank=rank, size=t), TPOptions(sequence_parallel=True))
        assert count_parameters(model) == tp_shard_parameter_count(LLAMA, t)
        for name, p in model.named_parameters():
            assert torch.equal(p, shards.local_part(name, full[name])), (rank, name)
        # rank r's query heads r·H/t.. read kv head r // (t/kv): its K rows are that head's
        head = rank // (t // LLAMA.kv_heads) if t > LLAMA.kv_heads else rank
        k = model.blocks[0].attn.k.weight
        assert torch.equal(k[:LLAMA.head_dim], full["blocks.0.attn.k.weight"][head * LLAMA.head_dim:][:LLAMA.head_dim])
        assert sum(shards.full_numel(n, p) for n, p in model.named_parameters()) == count_parameters(GPT(LLAMA))
    assert shards.replicas == ({f"blocks.{i}.attn.{x}.weight": 2 for i in range(4) for x in "kv"} if t == 4 else {})
    # RMSNorm weights only (no biases, no position table) are completed over tp under sequence parallelism
    assert sorted(shards.sequence_partial) == sorted(
        [f"blocks.{i}.ln{j}.weight" for i in range(4) for j in (1, 2)] + ["head.ln_f.weight"])
    assert isinstance(model.blocks[0].ln1, NormIntoTP) and model.blocks[0].ln1.bias is None


def test_kv_heads_split_or_replicated():
    assert [ModelShape(LLAMA).kv_replicas(t) for t in (1, 2, 4)] == [1, 1, 2]
    assert [ModelShape(LLAMA).kv_heads_per_rank(t) for t in (1, 2, 4)] == [2, 1, 1]
    h, h_kv = LLAMA.d_model, LLAMA.kv_width
    assert [kv_replica_grad_count(LLAMA, t, 4) for t in (1, 2, 4)] == [0, 0, 4 * 2 * h * h_kv]
