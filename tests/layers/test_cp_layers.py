"""Context parallelism's layers on real gloo groups of 2 and 4 ranks, against the unsplit attention.

One pytest process spawns the cp ranks (a TCPStore on a port the OS picks, so no fixed port can
race); each rank runs the ring and the all-to-all attention on its shard of the same random
q, k, v, and the whole GPT with its embedding and cores replaced, and reports back. The reference
is the model's own AttentionCore (SDPA, causal) on the full sequence, computed on every rank.

Grouped-query attention (K, V with 2 heads for 4 query heads) runs the same checks in float64: the
ring with K, V unexpanded, the all-to-all at cp 2 with one kv head per rank and at cp 4 with each
kv head replicated on two ranks; and Llama's whole block (rotary positions of the rank's chunks).

Tolerance, relative to the reference tensor's largest element: max|cp − reference| <= 1e-6·max|reference|
in fp32 (measured here: up to 5e-7 for the ring, 0 for the all-to-all, whose inner attention is the
same SDPA call on the same numbers), and <= 1e-12 in float64, where the ring's fp32 rounding
no longer hides an algorithmic error (measured: about 1e-16).
"""

import datetime
import os
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from parallel.core.model import GPT, AttentionCore, GPTConfig
from parallel.cp.layout import (
    check_divisible,
    layout_order,
    rank_chunks,
    rank_positions,
    shard_sequence,
    validate,
)
from parallel.cp.ring import RingAttentionCore
from parallel.cp.theory import ring_layer_traffic, step_sent, ulysses_layer_traffic
from parallel.cp.transform import parallelize_cp
from parallel.cp.ulysses import UlyssesAttentionCore
from parallel.dist.comm import CommLog, Communicator
from parallel.dist.groups import exit_process

WORLD = 4
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
B, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8  # attention inputs (batch, heads, seq, head_dim)
MODEL = GPTConfig(seq_len=16, n_layers=2, d_model=32, n_heads=4)
KV_HEADS = 2  # grouped-query attention: each K/V head serves two query heads
LLAMA = GPTConfig(seq_len=16, n_layers=2, d_model=32, n_heads=4, n_kv_heads=KV_HEADS, ffn_hidden=64, gated_mlp=True,
                  norm="rmsnorm", position_embedding="rope", bias=False)
CORES = {"ring": RingAttentionCore, "a2a": UlyssesAttentionCore}
DTYPES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2}  # bytes per element


def _max_diff(a: torch.Tensor, reference: torch.Tensor) -> float:
    """max|a − reference| / max|reference|."""
    return ((a.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def _attention_check(comm: Communicator, kind: str, dtype: torch.dtype, kv_heads: int = HEADS) -> dict:
    """One layer's output and input gradients against the unsplit core, and the traffic it logged."""
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, SEQ, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = AttentionCore()(*full)
    reference.backward(dout)

    def shard(t):
        return shard_sequence(t.detach(), comm.rank, comm.size, dim=2)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    comm.log.begin_step()
    out = CORES[kind](comm, "cp/layer")(*local)
    out.backward(shard(dout))
    traffic = comm.log.end_step()
    return {
        "out": _max_diff(out, shard(reference)),
        **{f"d{n}": _max_diff(t.grad, shard(r.grad)) for n, t, r in zip("qkv", local, full)},
        "dtypes": [str(t.dtype) for t in (out, *(t.grad for t in local))],
        "traffic": {key: (t.calls, t.payload_bytes, t.sent_bytes) for key, t in traffic.items()},
    }


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # token_loss_sum in the logits' own dtype (the model's casts to fp32, which would hide float64).
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def _model_check(comm: Communicator, kind: str, dtype: torch.dtype, config: GPTConfig = MODEL) -> dict:
    """The whole GPT on this rank's tokens: the loss and the parameter gradients summed over cp
    equal the single model's."""
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, config.vocab_size, (B, config.seq_len), generator=gen)
    targets = torch.randint(0, config.vocab_size, (B, config.seq_len), generator=gen)
    single, model = GPT(config, seed=0).to(dtype), GPT(config, seed=0).to(dtype)
    single_loss = _loss_sum(single(idx), targets)
    single_loss.backward()
    parallelize_cp(model, comm, kind)
    loss = _loss_sum(model(shard_sequence(idx, comm.rank, comm.size)), shard_sequence(targets, comm.rank, comm.size))
    loss.backward()
    # Test-side sums (not the strategy's traffic, so straight through torch.distributed).
    summed = torch.cat([loss.detach().reshape(1), *(p.grad.reshape(-1) for p in model.parameters())])
    dist.all_reduce(summed, group=comm.group)
    single_grads = torch.cat([p.grad.reshape(-1) for p in single.parameters()])
    return {"loss": abs(summed[0].item() - single_loss.item()) / single_loss.item(),
            "grads": _max_diff(summed[1:], single_grads)}


def _worker(rank: int, port: int, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    # cp 4 over all four ranks; cp 2 over ranks {0, 1} and {2, 3} at once (every rank creates both).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for cp, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        comm = Communicator("cp", group, CommLog(timed=False))
        report = {}
        for kind in CORES:
            for dtype in DTYPES:
                report[kind, dtype] = _attention_check(comm, kind, dtype)
            for dtype in TOL:
                report[kind, dtype, "model"] = _model_check(comm, kind, dtype)
            report[kind, "gqa"] = _attention_check(comm, kind, torch.float64, kv_heads=KV_HEADS)
            report[kind, "llama"] = _model_check(comm, kind, torch.float64, LLAMA)
        results[cp, rank] = report
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort interpreter finalisation (parallel/dist/groups.py: exit_process).
    exit_process(0)


@pytest.fixture(scope="module")
def spawned():
    """{(cp, global rank): report}: one spawn of four ranks serves cp 4 and both cp-2 groups."""
    # The parent holds the store on a port the OS chose; the ranks connect to it as clients.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(store.port, results), nprocs=WORLD, join=True)
    return dict(results)


@pytest.fixture(params=[2, 4], ids=lambda cp: f"cp{cp}")
def reports(request, spawned):
    """(cp, [each rank's report]) for every rank that ran at that cp."""
    cp = request.param
    return cp, [spawned[cp, rank] for rank in range(WORLD)]


@pytest.mark.parametrize("dtype", TOL, ids=str)
@pytest.mark.parametrize("kind", CORES)
def test_output_and_input_grads_equal_the_unsplit_attention(reports, kind, dtype):
    _, by_rank = reports
    for rank, report in enumerate(by_rank):
        r = report[kind, dtype]
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) <= TOL[dtype], (rank, r)
        assert r["dtypes"] == [str(dtype)] * 4


@pytest.mark.parametrize("dtype", TOL, ids=str)
@pytest.mark.parametrize("kind", CORES)
def test_the_whole_model_on_cp_ranks_equals_the_single_model(reports, kind, dtype):
    _, by_rank = reports
    for rank, report in enumerate(by_rank):
        r = report[kind, dtype, "model"]
        assert r["loss"] <= TOL[dtype] and r["grads"] <= TOL[dtype], (rank, r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", CORES)
def test_logged_bytes_equal_the_closed_form(reports, kind, dtype):
    cp, by_rank = reports
    layer_traffic = ring_layer_traffic if kind == "ring" else ulysses_layer_traffic
    closed = layer_traffic(B, SEQ, HEADS, HEAD_DIM, cp, DTYPES[dtype])
    for _rank, report in enumerate(by_rank):
        r = report[kind, dtype]
        traffic = r["traffic"]
        fwd, bwd = traffic[(closed.op, "cp", "cp/layer/fwd")], traffic[(closed.op, "cp", "cp/layer/bwd")]
        assert (fwd[0], fwd[2]) == (closed.fwd_calls, closed.fwd_sent)
        assert (bwd[0], bwd[2]) == (closed.bwd_calls, closed.bwd_sent)
        assert sum(t[2] for t in traffic.values()) == closed.sent  # nothing else sent
        if kind == "ring":  # every send has its receive, which sends nothing
            assert traffic[("recv", "cp", "cp/layer/fwd")][:3:2] == (closed.fwd_calls, 0)
            assert traffic[("recv", "cp", "cp/layer/bwd")][:3:2] == (closed.bwd_calls, 0)


@pytest.mark.parametrize("kind", CORES)
def test_grouped_query_attention_equals_the_unsplit_attention_and_sends_kv_heads(reports, kind):
    """K, V with fewer heads: outputs, gradients (dK, dV summed over each kv head's query heads)
    and the whole Llama-shaped model as unsplit, in float64; the bytes those of the kv heads."""
    cp, by_rank = reports
    closed = (ring_layer_traffic(B, SEQ, KV_HEADS, HEAD_DIM, cp, 8) if kind == "ring"
              else ulysses_layer_traffic(B, SEQ, HEADS, HEAD_DIM, cp, 8, kv_heads=KV_HEADS))
    for rank, report in enumerate(by_rank):
        r, model = report[kind, "gqa"], report[kind, "llama"]
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) <= TOL[torch.float64], (rank, r)
        assert model["loss"] <= TOL[torch.float64] and model["grads"] <= TOL[torch.float64], (rank, model)
        assert sum(t[2] for t in r["traffic"].values()) == closed.sent


def test_bf16_activations_stay_bf16_and_close(reports):
    """Under bf16 the ring computes in fp32 and hands back bf16; its numbers are attention's to
    bf16's resolution (2^-8 relative)."""
    _, by_rank = reports
    for rank, report in enumerate(by_rank):
        for kind in CORES:
            r = report[kind, torch.bfloat16]
            assert r["dtypes"] == ["torch.bfloat16"] * 4
            assert max(r["out"], r["dq"], r["dk"], r["dv"]) <= 2 ** -6, (kind, rank, r)


# -- the pure parts: no process group ------------------------------------------------------------
def test_closed_forms_by_hand():
    # cp 4, b 2, a 4, s 32, d 8: a rank's K is 2·4·8·8 = 512 elements.
    ring = ring_layer_traffic(2, 32, 4, 8, 4, 4)
    assert (ring.fwd_calls, ring.fwd_sent, ring.bwd_calls, ring.bwd_sent) == (3, 3 * 1024 * 4, 6, 3 * 1024 * 8)
    a2a = ulysses_layer_traffic(2, 32, 4, 8, 4, 2)
    assert (a2a.fwd_sent, a2a.bwd_sent) == (Fraction(3, 4) * 4 * 512 * 2,) * 2
    assert ring_layer_traffic(2, 32, 4, 8, 1, 4).sent == ulysses_layer_traffic(2, 32, 4, 8, 1, 4).sent == 0
    assert step_sent(ring, n_layers=3, microbatches=2) == 6 * ring.sent


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_round_trips_and_balances(cp):
    seq = 8 * cp
    x = torch.arange(3 * seq).reshape(3, seq)
    pieces = [shard_sequence(x, r, cp) for r in range(cp)]
    order = layout_order(cp, seq)
    assert torch.equal(torch.sort(order).values, torch.arange(seq))  # every position held once
    assert torch.equal(torch.cat(pieces, dim=1), x[:, order])  # the pieces end to end: x in layout order
    for r in range(cp):
        assert torch.equal(pieces[r][0], rank_positions(r, cp, seq))  # x's row 0 is its positions
        first, second = rank_chunks(r, cp)
        assert first + second == 2 * cp - 1
        # Causal work (query-key pairs at or below the diagonal) is the same on every rank.
        assert sum(int(p) + 1 for p in rank_positions(r, cp, seq)) == sum(range(1, seq + 1)) // cp


def test_layout_refusals_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible by 2 x cp = 4.*multiple of 4"):
        check_divisible(30, 2)
    with pytest.raises(ValueError, match=r"parallel.cp=3 does not divide the 4 attention heads.*cp in \[1, 2, 4\]"):
        validate("a2a", 3, 36, 4)
    with pytest.raises(ValueError, match=r"model.dropout=0.1.*set model.dropout=0"):
        validate("ring", 2, 32, 4, attention_dropout=0.1)
    validate("ring", 3, 36, 4)  # the ring has no head rule
    validate("a2a", 4, 32, 4)
