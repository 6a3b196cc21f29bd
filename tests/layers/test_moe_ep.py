"""Expert parallelism at the layer level, on real gloo groups of 2 and 4 ranks in one pytest process:
the all-to-all in the communication log, an MoE layer with its experts sharded over the ep ranks
against the unsharded layer (outputs, input and weight gradients, top-1 and top-2, with drops), and
every logged byte against the exact figure from the routing counts (parallel/moe/theory.py)."""

import copy
import os
import tempfile
from dataclasses import replace
from datetime import timedelta
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.core.model import GPT, GPTConfig
from parallel.dist.comm import CommLog, Communicator, ring_bytes_sent, summarize_traffic
from parallel.dist.groups import exit_process
from parallel.moe.expert_parallel import ExpertParallelMoE, local_expert_range
from parallel.moe.theory import CALLS, exact_sent_per_rank, layer_call_bytes, rank_rows, uniform_sent_per_rank

H, S, EXPERTS = 16, 8, 8
BASE = GPTConfig(seq_len=S, n_layers=1, d_model=H, n_heads=2, moe_experts=EXPERTS, moe_aux_weight=0.05)
# (name, top_k, capacity factor). A factor of E/k gives a capacity of s per sequence: nothing can
# be dropped. 1.25 is the presets' factor; with the skewed routing below, experts overflow.
CASES = [("top1", 1, EXPERTS / 1), ("top1_drops", 1, 1.25), ("top2", 2, EXPERTS / 2), ("top2_drops", 2, 1.25)]
WORLD = 4  # one spawn: the world is the ep=4 group, and ranks {0, 1} and {2, 3} two ep=2 groups
SEQUENCES_PER_RANK = 3
TAG = "ep/blocks.0.mlp"


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, tiny): the error relative to the tensor's scale."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _layer_case(comm: Communicator, log: CommLog, top_k: int, factor: float, data_seed: int) -> dict:
    rank, world = comm.rank, comm.size
    cfg = replace(BASE, moe_top_k=top_k, moe_capacity_factor=factor)
    full = GPT(cfg, seed=7).blocks[0].mlp
    with torch.no_grad():
        full.router.weight.mul_(40)  # a confident router, so routing is skewed and experts overflow
    sharded = ExpertParallelMoE(copy.deepcopy(full), comm, TAG)

    gen = torch.Generator().manual_seed(data_seed)  # the same global batch on every rank of the group
    x_full = (torch.randn(world * SEQUENCES_PER_RANK, S, H, generator=gen) + 0.3).requires_grad_()
    weight_out = torch.randn(x_full.shape, generator=gen)  # loss = <y, w> + balancing loss
    mine = slice(rank * SEQUENCES_PER_RANK, (rank + 1) * SEQUENCES_PER_RANK)

    y_full = full(x_full)  # the unsharded reference, on every rank
    ((y_full * weight_out).sum() + full.aux_loss_sum).backward()

    x = x_full.detach()[mine].clone().requires_grad_()
    log.begin_step()
    y = sharded(x)
    ((y * weight_out[mine]).sum() + sharded.aux_loss_sum).backward()
    traffic = log.end_step()

    local = local_expert_range(EXPERTS, world, rank)
    full_params = dict(full.named_parameters())
    expert_errors = [_max_rel(p.grad, full_params[f"experts.{name}"].grad)
                     for name, p in sharded.experts.named_parameters()]
    return {
        "local_experts": [int(e) for e in sharded.experts], "expected_local": list(local),
        "output": _max_rel(y.detach(), y_full.detach()[mine]),
        "input_grad": _max_rel(x.grad, x_full.grad[mine]),
        "expert_grads": max(expert_errors),
        "router_grad": sharded.router.weight.grad.clone(), "router_grad_full": full.router.weight.grad.clone(),
        "aux": sharded.aux_loss_sum.item(), "aux_full": full.aux_loss_sum.item(),
        "counts": sharded.kept_counts.tolist(), "counts_full": full.kept_counts.tolist(),
        "routed": sharded.routed_counts.tolist(),
        "traffic": {tag: (t.calls, t.payload_bytes, t.sent_bytes) for (op, group, tag), t in traffic.items()
                    if op == "all_to_all" and group == "ep"},
        "strategy_sent": summarize_traffic(traffic)["total"].sent_bytes,
    }


def _all_to_all_checks(comm: Communicator, log: CommLog) -> dict:
    """Uneven splits: rank r sends r + j + 1 rows of 3 floats to rank j (its own block included)."""
    rank, world = comm.rank, comm.size
    log.begin_step()
    send = [rank + j + 1 for j in range(world)]
    recv = [q + rank + 1 for q in range(world)]
    rows = torch.cat([torch.full((n, 3), float(100 * rank + j)) for j, n in enumerate(send)])
    out = torch.empty(sum(recv), 3)
    comm.all_to_all_single(out, rows, "uneven", output_split_sizes=recv, input_split_sizes=send)
    # Even splits, asynchronous: the ring formula's case.
    even_in, even_out = torch.arange(4.0 * world) + 10 * rank, torch.empty(4 * world)
    handle = comm.all_to_all_single(even_out, even_in, "even", async_op=True)
    handle.wait()
    traffic = log.end_step()
    expected = torch.cat([torch.full((n, 3), float(100 * q + rank)) for q, n in enumerate(recv)])
    even_expected = torch.cat([torch.arange(4.0 * rank, 4.0 * rank + 4) + 10 * q for q in range(world)])
    return {
        "uneven_ok": torch.equal(out, expected), "even_ok": torch.equal(even_out, even_expected),
        "uneven": traffic[("all_to_all", "ep", "uneven")], "even": traffic[("all_to_all", "ep", "even")],
        "send": send,
    }


def _worker(rank, store_path, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        groups = {4: (0, dist.group.WORLD), 2: (rank // 2, pairs[rank // 2])}
        for ep, (index, group) in groups.items():
            log = CommLog(timed=False)
            comm = Communicator("ep", group, log)
            out = {"all_to_all": _all_to_all_checks(comm, log)}
            for name, top_k, factor in CASES:
                out[name] = _layer_case(comm, log, top_k, factor, data_seed=11 + index)
            results[(ep, index, comm.rank)] = out
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort interpreter finalisation (parallel/dist/groups.py: exit_process).
    exit_process(0)


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), results), nprocs=WORLD, join=True)
        return dict(results)


# ep = 4 once, and ep = 2 twice (two groups on different data).
@pytest.fixture(params=[(4, 0), (2, 0), (2, 1)], ids=["ep4", "ep2", "ep2b"])
def ep_run(request, runs):
    ep, index = request.param
    return ep, {rank: runs[(ep, index, rank)] for rank in range(ep)}


def test_all_to_all_moves_the_rows_and_logs_what_each_rank_sends(ep_run):
    world, results = ep_run
    row_bytes = 3 * 4
    for rank in range(world):
        r = results[rank]["all_to_all"]
        assert r["uneven_ok"] and r["even_ok"]
        calls, payload, sent = r["uneven"].calls, r["uneven"].payload_bytes, r["uneven"].sent_bytes
        assert (calls, payload) == (1, sum(r["send"]) * row_bytes)
        assert sent == sum(n for j, n in enumerate(r["send"]) if j != rank) * row_bytes  # its own block stays
        even = r["even"]
        payload = 4 * world * 4
        assert even.sent_bytes == ring_bytes_sent("all_to_all", payload, world) == Fraction(world - 1, world) * payload


@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_sharded_experts_match_the_unsharded_layer(ep_run, case):
    world, results = ep_run
    ranks = [results[r][case] for r in range(world)]
    for r in ranks:
        assert r["local_experts"] == r["expected_local"]
        assert r["output"] < 1e-6 and r["input_grad"] < 1e-6 and r["expert_grads"] < 1e-6, r
    # The router is replicated: its gradient is this rank's tokens' share; the shares add up.
    router = sum(r["router_grad"] for r in ranks)
    assert _max_rel(router, ranks[0]["router_grad_full"]) < 1e-6
    assert sum(r["aux"] for r in ranks) == pytest.approx(ranks[0]["aux_full"], rel=1e-6)
    # The same assignments are kept as in the unsharded layer.
    assert [sum(col) for col in zip(*(r["counts"] for r in ranks))] == ranks[0]["counts_full"]
    dropped = sum(sum(r["routed"]) - sum(r["counts"]) for r in ranks)
    assert (dropped > 0) == case.endswith("_drops")


@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_logged_bytes_are_the_exact_figure_from_the_routing(ep_run, case):
    world, results = ep_run
    ranks = [results[r][case] for r in range(world)]
    counts = [r["counts"] for r in ranks]  # counts[r][e]: kept assignments of rank r's tokens to expert e
    expected = layer_call_bytes(counts, H, 4)
    rows = rank_rows(counts)
    assert sum(r["out"] for r in rows) > 0  # rows really cross between ranks
    assert len({r["dispatched"] for r in rows}) > 1 or len({r["received"] for r in rows}) > 1  # skewed
    for rank, r in enumerate(ranks):
        assert set(r["traffic"]) == {f"{TAG}/{call}" for call in CALLS}
        for call in CALLS:
            assert r["traffic"][f"{TAG}/{call}"] == (1, expected[rank][call].payload, expected[rank][call].sent), call
        assert r["strategy_sent"] == exact_sent_per_rank([counts], H, 4)[rank]


# -- traffic theory alone (no processes) ----------------------------------------------------------
def test_uniform_routing_is_the_closed_form():
    """Every rank sends T·k/E assignments to each expert: the exact figure from those counts is the
    uniform-routing closed form, per rank, for any number of blocks and microbatches."""
    tokens, k, n = 24, 2, 4
    counts = [[tokens * k // EXPERTS] * EXPERTS for _ in range(n)]
    exact = exact_sent_per_rank([counts] * 6, H, 4)  # 3 MoE blocks x 2 microbatches
    uniform = uniform_sent_per_rank(tokens, k, H, EXPERTS, n, 4, moe_blocks=3, microbatches=2)
    assert exact == [uniform] * n
    # The closed form spelled out: 4 all-to-alls of (n-1)/n of T·k rows, and the counts.
    assert uniform == 6 * (4 * Fraction(3, 4) * tokens * k * H * 4 + Fraction(3, 4) * EXPERTS * 8)


def test_skew_decides_the_bytes():
    """All of rank 0's tokens to its own experts: it sends no rows; everything rank 1 routes to rank
    0's experts crosses. Row bytes per rank follow the counts, not the token count."""
    counts = [[5, 7, 0, 0], [3, 1, 2, 0]]  # 2 ranks, 4 experts: rank 0 holds experts 0 and 1
    calls = layer_call_bytes(counts, d_model=2, dtype_bytes=4)
    assert calls[0]["dispatch/fwd"].sent == 0 and calls[0]["combine/fwd"].sent == (3 + 1) * 8
    assert calls[1]["dispatch/fwd"].sent == (3 + 1) * 8 and calls[1]["combine/fwd"].sent == 0
    assert calls[0]["dispatch/fwd"].payload == 12 * 8 and calls[0]["combine/fwd"].payload == 16 * 8
    assert calls[0]["counts"].sent == calls[1]["counts"].sent == 2 * 8
    assert exact_sent_per_rank([counts], 2, 4) == [2 * 4 * 8 + 16, 2 * 4 * 8 + 16]
