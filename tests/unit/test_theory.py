"""The closed forms (parallel/algebra.py and the families' theory.py) against the formulas of
docs/theory/, written out here a second time."""

from fractions import Fraction
from types import SimpleNamespace

import pytest

from parallel.algebra import parameter_count, tp_shard_parameter_count
from parallel.core.model import GPT, GPTConfig, count_parameters
from parallel.dist.comm import ring_bytes_sent
from parallel.dist.dims import ParallelDims
from parallel.registry import expected_comm
from parallel.tp.layers import parallelize_tp

CFG = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_bytes_table(n):
    S = 1000
    # docs/theory/collectives.md: bytes one rank sends in a bandwidth-optimal (ring) algorithm
    assert ring_bytes_sent("all_reduce", S, n) == Fraction(2 * (n - 1) * S, n)
    assert ring_bytes_sent("reduce_scatter", S, n) == Fraction((n - 1) * S, n)
    assert ring_bytes_sent("all_gather", S, n) == Fraction((n - 1) * S, n)
    assert ring_bytes_sent("all_to_all", S, n) == Fraction((n - 1) * S, n)
    assert ring_bytes_sent("broadcast", S, n) == (S if n > 1 else 0)
    assert ring_bytes_sent("send", S, n) == S
    assert ring_bytes_sent("recv", S, n) == 0


def test_unknown_op_has_no_formula():
    with pytest.raises(ValueError, match="no ring formula"):
        ring_bytes_sent("scatter_gather_dance", 10, 2)


def test_parameter_count_is_the_references_formula():
    V, h, s, L = 256, 64, 32, 4
    assert parameter_count(CFG) == V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h + V * h


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_dp_traffic_is_one_allreduce_of_all_gradients(world):
    psi = parameter_count(CFG)
    fig = expected_comm("dp", CFG, ParallelDims.resolve(world))
    per_rank = Fraction(2 * (world - 1), world) * psi * 4
    assert Fraction(fig["sent_bytes_per_step_exact"]) == per_rank * world
    assert fig["sent_bytes_per_rank_per_step"] == float(per_rank)
    assert list(fig["by_op"]) == ["all_reduce"]
    assert fig["by_op"]["all_reduce"]["payload_bytes"] == psi * 4 * world
    assert expected_comm("torch_ddp", CFG, ParallelDims.resolve(world)) == fig


def test_single_moves_nothing():
    fig = expected_comm("single", CFG, ParallelDims.resolve(1))
    assert fig["sent_bytes_per_step"] == 0 and fig["by_op"] == {}


def test_unknown_strategy_has_no_formula():
    with pytest.raises(ValueError, match="parallel.name='carrier_pigeon' is not a strategy"):
        expected_comm("carrier_pigeon", CFG, ParallelDims.resolve(2))


# -- tensor parallelism ---------------------------------------------------------------------------
H, S, L = 64, 32, 4


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("b,m", [(1, 1), (4, 2)])
def test_tp_traffic_is_the_megatron_count(t, b, m):
    fig = expected_comm("tp", CFG, ParallelDims.resolve(t, tp=t), microbatch_size=b, microbatches=m)
    # docs/theory/tensor-parallel.md: per layer and microbatch 8·b·s·h·(t-1)/t elements sent per rank (2 forward
    # + 2 backward all-reduces of b·s·h); the vocab-parallel embedding one more all-reduce of
    # b·s·h forward, the head's input gradient one backward; the loss 3 all-reduces of b·s.
    per_layer = 8 * b * S * H * Fraction(t - 1, t)
    embedding_and_head = 2 * 2 * Fraction(t - 1, t) * b * S * H
    loss = 3 * 2 * Fraction(t - 1, t) * b * S
    per_rank = 4 * m * (L * per_layer + embedding_and_head + loss)
    assert Fraction(fig["sent_bytes_per_step_exact"]) == per_rank * t
    assert list(fig["by_op"]) == ["all_reduce"] and list(fig["by_group"]) == ["tp"]
    assert fig["per_layer_per_microbatch"] == {"fwd": {"all_reduce": 2}, "bwd": {"all_reduce": 2}}


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("b,m", [(1, 1), (4, 2)])
def test_sequence_parallel_moves_the_same_activation_bytes(t, b, m):
    dims = ParallelDims.resolve(t, tp=t)
    tp = expected_comm("tp", CFG, dims, microbatch_size=b, microbatches=m)
    sp = expected_comm("tp", CFG, dims, microbatch_size=b, microbatches=m, sequence_parallel=True)
    # Korthikanti §4.2.2: each all-reduce of b·s·h becomes an all-gather plus a reduce-scatter,
    # (t-1)/t of b·s·h each: the same bytes in twice the ops.
    activations = (4 * L + 2) * m * b * S * H * 4
    for op in ("all_gather", "reduce_scatter"):
        assert Fraction(sp["by_op"][op]["sent_bytes_exact"]) == Fraction(t - 1, t) * activations * t
        assert sp["by_op"][op]["payload_bytes"] == activations * t
    # What sequence parallelism adds: one all-reduce per step of the gradients its ranks hold in
    # part: per layer two LayerNorms and two row-parallel biases, the final LayerNorm, positions.
    norm_grads = (L * (4 * H + 2 * H) + 2 * H + S * H) * 4
    extra = Fraction(sp["sent_bytes_per_step_exact"]) - Fraction(tp["sent_bytes_per_step_exact"])
    assert extra == 2 * Fraction(t - 1, t) * norm_grads * t
    assert sp["per_layer_per_microbatch"]["fwd"] == {"all_gather": 2, "reduce_scatter": 2}


def test_dp_x_tp_adds_one_allreduce_of_the_local_shard_over_dp():
    dims = ParallelDims.resolve(4, tp=2)
    fig = expected_comm("tp", CFG, dims, microbatch_size=8)
    alone = expected_comm("tp", CFG, ParallelDims.resolve(2, tp=2), microbatch_size=8)
    shard = tp_shard_parameter_count(CFG, 2)
    assert Fraction(fig["by_group"]["dp"]["sent_bytes_exact"]) == 2 * Fraction(1, 2) * shard * 4 * 4
    # The tp traffic of each tp group is that of tp alone, twice over (two groups).
    assert Fraction(fig["by_group"]["tp"]["sent_bytes_exact"]) == 2 * Fraction(alone["sent_bytes_per_step_exact"])


@pytest.mark.parametrize("t", [1, 2, 4])
def test_shard_parameter_count_is_what_parallelize_tp_leaves(t):
    total_sharded = 0
    for rank in range(t):
        model = GPT(CFG, seed=0)
        # parallelize_tp only reads the rank and size while cutting; no collective runs.
        shards = parallelize_tp(model, SimpleNamespace(rank=rank, size=t))
        assert count_parameters(model) == tp_shard_parameter_count(CFG, t)
        total_sharded += sum(p.numel() for n, p in model.named_parameters() if n in shards.split_dim)
    replicated = sum(p.numel() for n, p in model.named_parameters() if n not in shards.split_dim)
    assert total_sharded + replicated == parameter_count(CFG)
    if t == 1:
        assert tp_shard_parameter_count(CFG, 1) == parameter_count(CFG)


# -- dp x tp x pp on one mesh -----------------------------------------------------------------------
def _stage_shard_sizes(d, t, p, v=1):
    """What one rank of each stage holds, counted on the model itself: cut by parallelize_tp, then
    split by split_model (no collective runs while cutting)."""
    from parallel.pp.split import split_model
    sizes = []
    for r in range(p):
        model = GPT(CFG, seed=0)
        parallelize_tp(model, SimpleNamespace(rank=0, size=t))
        sizes.append(sum(q.numel() for chunk in split_model(model, p, v, r) for q in chunk.parameters()))
    return sizes


@pytest.mark.parametrize("d,t,p,v,b,m,sp", [
    (2, 2, 2, 1, 4, 2, False), (2, 2, 2, 1, 4, 2, True), (1, 2, 2, 2, 8, 2, False), (2, 2, 1, 1, 4, 2, True),
    (1, 2, 4, 1, 2, 4, False),
])
def test_3d_traffic_written_out_stage_by_stage(d, t, p, v, b, m, sp):
    dims = ParallelDims.resolve(d * t * p, dp=d, tp=t, pp=p)
    fig = expected_comm("3d", CFG, dims, microbatch_size=b, microbatches=m, virtual=v, sequence_parallel=sp)
    shard = _stage_shard_sizes(d, t, p, v)
    assert sum(shard) == tp_shard_parameter_count(CFG, t)  # the stages partition the tp shard
    q = Fraction(t - 1, t)
    bsh = b * S * H
    per_rank = []
    for r in range(p):
        first, last = r == 0, r == p - 1
        layers = L // p
        # tp, only the blocks this stage holds: 2 fwd + 2 bwd tensors of b·s·h per block and
        # microbatch, plus the embedding's one on the first stage and the head's one on the last.
        acts = (4 * layers + first + last) * m * bsh * 4
        loss = 3 * m * b * S * 4 if last else 0
        sp_grads = (6 * H * layers + S * H * first + 2 * H * last) * 4 if sp else 0
        tp_bytes = 2 * q * (acts + loss + sp_grads)  # as all-reduces, or AG + RS: the same bytes
        # pp: each chunk sends its output forward unless it is the last virtual stage, its input
        # gradient backward unless it is the first; b·s·h, or the b·(s/t)·h piece under sp.
        boundary = b * (S // t if sp else S) * H * 4
        sends = sum(m * ((c * p + r < v * p - 1) + (c * p + r > 0)) for c in range(v))
        # dp: this rank's own gradients, once per step.
        dp_bytes = 2 * Fraction(d - 1, d) * shard[r] * 4
        per_rank.append(tp_bytes + sends * boundary + dp_bytes)
    assert [Fraction(x) for x in fig["sent_bytes_per_rank_by_stage_exact"]] == per_rank
    assert Fraction(fig["sent_bytes_per_step_exact"]) == d * t * sum(per_rank)

    # Summed over stages, tp and dp are those of `tp` at the same d and t; pp adds
    # 2·m·(v·p-1)·b·s·h·4 per pipeline (the piece of the sequence under sp), d·t pipelines.
    alone = expected_comm("tp", CFG, ParallelDims.resolve(d * t, tp=t), microbatch_size=b, microbatches=m,
                          sequence_parallel=sp)
    groups = fig["by_group"]
    assert Fraction(groups["tp"]["sent_bytes_exact"]) == Fraction(alone["by_group"]["tp"]["sent_bytes_exact"])
    if d > 1:
        assert Fraction(groups["dp"]["sent_bytes_exact"]) == Fraction(alone["by_group"]["dp"]["sent_bytes_exact"])
    p2p = 2 * m * (v * p - 1) * b * S * H * 4 // (t if sp else 1) * d * t
    assert Fraction(groups.get("pp", {"sent_bytes_exact": "0"})["sent_bytes_exact"]) == p2p
    assert set(groups) == {"tp"} | ({"dp"} if d > 1 else set()) | ({"pp"} if p > 1 else set())


def test_3d_without_tp_is_pp_and_without_pp_is_tp():
    for d, p, v in ((1, 2, 1), (2, 2, 1), (2, 2, 2), (1, 4, 1)):
        dims = ParallelDims.resolve(d * p, dp=d, tp=1, pp=p)
        pp = expected_comm("pp", CFG, dims, microbatch_size=2, microbatches=4, virtual=v)
        assert expected_comm("3d", CFG, dims, microbatch_size=2, microbatches=4, virtual=v)["by_op"] == pp["by_op"]
    for d, t, sp in ((1, 2, False), (2, 2, True), (2, 4, False)):
        dims = ParallelDims.resolve(d * t, dp=d, tp=t, pp=1)
        tp = expected_comm("tp", CFG, dims, microbatch_size=4, microbatches=2, sequence_parallel=sp)
        assert expected_comm("3d", CFG, dims, microbatch_size=4, microbatches=2,
                             sequence_parallel=sp)["by_op"] == tp["by_op"]

# -- ZeRO and FSDP2 ---------------------------------------------------------------------------------
from parallel.algebra import part_parameter_counts, zero_padded_parameter_count  # noqa: E402
from parallel.registry import model_state_bytes  # noqa: E402


def test_parts_add_up_to_the_whole_model():
    assert part_parameter_counts(CFG) == [256 * H + S * H, *[12 * H * H + 13 * H] * L, 2 * H + 256 * H]
    assert sum(part_parameter_counts(CFG)) == parameter_count(CFG)
    model = GPT(CFG, seed=0)
    parts = [model.embed, *model.blocks, model.head]
    assert [count_parameters(p) for p in parts] == part_parameter_counts(CFG)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2])
def test_zero_traffic_is_the_papers_on_the_padded_size(n, m):
    # Each part padded to a multiple of n: a Block's 12h² + 13h = 49,984 is a multiple of 2 and 4
    # and 8 but needs 2 more at n = 3.
    block = 12 * H * H + 13 * H
    psi_pad = (256 * H + S * H) + L * (-(-block // n) * n) + (2 * H + 256 * H)
    assert zero_padded_parameter_count(CFG, n) == psi_pad
    assert (psi_pad > parameter_count(CFG)) == (n == 3)
    dims = ParallelDims.resolve(n)
    P = G = psi_pad * 4
    # Rajbhandari et al. §7: ZeRO-1/2 (N-1)/N·(G + P), ZeRO-3 (N-1)/N·(2P + G) per rank (m = 1);
    # here stage 2 reduce-scatters each microbatch and stage 3 does all of it per microbatch.
    for strategy, per_rank in (("zero1", Fraction(n - 1, n) * (G + P)), ("zero2", Fraction(n - 1, n) * (m * G + P)),
                               ("zero3", m * Fraction(n - 1, n) * (2 * P + G))):
        fig = expected_comm(strategy, CFG, dims, microbatches=m)
        assert Fraction(fig["sent_bytes_per_step_exact"]) == per_rank * n, strategy
        assert set(fig["by_op"]) == {"all_gather", "reduce_scatter"}
    # ZeRO-1/2 with one microbatch moves what plain dp's all-reduce moves (on the padded size).
    assert Fraction(expected_comm("zero2", CFG, dims)["sent_bytes_per_step_exact"]) == \
        Fraction(2 * (n - 1), n) * psi_pad * 4 * n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_model_state_bytes_are_the_papers(n):
    psi, pad = parameter_count(CFG), zero_padded_parameter_count(CFG, n)
    dims = ParallelDims.resolve(n)
    # fp32 Adam: params 4Ψ, grads 4Ψ, Adam moments 8Ψ; stage 1 shards the moments, 2 also the
    # grads, 3 also the params.
    assert model_state_bytes("dp", CFG, dims)["total_bytes"] == 16 * psi
    expected = {"zero1": (4 * pad, 4 * pad, 8 * pad // n), "zero2": (4 * pad, 4 * pad // n, 8 * pad // n),
                "zero3": (4 * pad // n, 4 * pad // n, 8 * pad // n)}
    for strategy, (p, g, o) in expected.items():
        fig = model_state_bytes(strategy, CFG, dims)
        assert (fig["param_bytes"], fig["grad_bytes"], fig["optimizer_bytes"]) == (p, g, o)
    assert model_state_bytes("tp", CFG, dims) is None


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fsdp2_traffic_pads_every_parameter_along_dim0(n):
    h, f, V = H, 4 * H, 256

    def pad(d0, rest=1):
        return n * -(-d0 // n) * rest

    block = 4 * pad(h) + 4 * (pad(h, h) + pad(h)) + pad(f, h) + pad(f) + pad(h, f) + pad(h)
    root = 2 * pad(V, h) + pad(S, h) + 2 * pad(h)
    fig = expected_comm("torch_fsdp2", CFG, ParallelDims.resolve(n))
    per_rank = Fraction(n - 1, n) * 4 * ((2 * L * block + root) + (L * block + root))
    assert Fraction(fig["sent_bytes_per_step_exact"]) == per_rank * n


@pytest.mark.parametrize("n,m", [(2, 1), (3, 2), (4, 4)])
def test_pytorch_zero1_and_zero2_traffic(n, m):
    """torch_zero2 (FSDP2 kept unsharded over the step): FSDP2's padded groups gathered once and
    reduce-scattered m times, our zero2's form; torch_zero1 (DDP + ZeroRedundancyOptimizer): the
    whole gradient all-reduced, every parameter broadcast (S counted on every rank)."""
    h, f, V = H, 4 * H, 256

    def pad(d0, rest=1):
        return n * -(-d0 // n) * rest

    block = 4 * pad(h) + 4 * (pad(h, h) + pad(h)) + pad(f, h) + pad(f) + pad(h, f) + pad(h)
    padded = L * block + 2 * pad(V, h) + pad(S, h) + 2 * pad(h)
    dims = ParallelDims.resolve(n)
    zero2 = expected_comm("torch_zero2", CFG, dims, microbatches=m)
    assert Fraction(zero2["sent_bytes_per_step_exact"]) == n * Fraction(n - 1, n) * 4 * padded * (1 + m)
    psi = parameter_count(CFG)
    zero1 = expected_comm("torch_zero1", CFG, dims, microbatches=m)
    assert Fraction(zero1["sent_bytes_per_step_exact"]) == n * (Fraction(2 * (n - 1), n) * 4 * psi + 4 * psi)
    assert set(zero1["by_op"]) == {"all_reduce", "broadcast"}


# -- ZeRO as the dp dimension of dp x tp x pp ----------------------------------------------------------
def _stage_part_sizes(t, p, v=1):
    """Per stage, the parts ZeRO shards (ZeRO groups a rank's parameters by model.part_of), counted
    on the model itself after the tp cut and the pipeline split."""
    from parallel.core.model import part_of as _part_of
    from parallel.pp.split import split_model
    sizes = []
    for r in range(p):
        model = GPT(CFG, seed=0)
        parallelize_tp(model, SimpleNamespace(rank=0, size=t))
        parts: dict[str, int] = {}
        for chunk in split_model(model, p, v, r):
            for n, q in chunk.named_parameters():
                parts[_part_of(chunk.global_name(n))] = parts.get(_part_of(chunk.global_name(n)), 0) + q.numel()
        sizes.append(parts)
    return sizes


@pytest.mark.parametrize("d,t,p,v,b,m,sp,zero", [
    (2, 2, 1, 1, 4, 2, True, 1), (2, 1, 2, 1, 4, 2, False, 2), (2, 2, 2, 2, 2, 4, False, 1),
    (3, 2, 1, 1, 2, 2, False, 2), (3, 2, 2, 1, 2, 2, False, 1),  # dp 3: parts padded to multiples of 3
])
def test_3d_with_zero_dp_written_out(d, t, p, v, b, m, sp, zero):
    from parallel.compose.theory import combined_model_state_bytes
    dims = ParallelDims.resolve(d * t * p, dp=d, tp=t, pp=p)
    kw = dict(microbatch_size=b, microbatches=m, virtual=v, sequence_parallel=sp)
    plain, fig = expected_comm("3d", CFG, dims, **kw), expected_comm("3d", CFG, dims, **kw, zero=zero)
    parts = _stage_part_sizes(t, p, v)
    padded = [sum(-(-n // d) * d for n in stage.values()) for stage in parts]
    if d == 3:
        assert sum(padded) > sum(sum(stage.values()) for stage in parts)  # the padding is real
    # Per rank of stage r: the all-reduce of its Ψ_r gradients, 2(d-1)/d·4Ψ_r, becomes a reduce-scatter of
    # its padded parts per step (ZeRO-1) or per microbatch (ZeRO-2) and one all-gather, (d-1)/d·4Ψ_pad,r each.
    scatters = 1 if zero == 1 else m
    zero_dp = [Fraction(d - 1, d) * (scatters + 1) * 4 * pad for pad in padded]
    plain_dp = [2 * Fraction(d - 1, d) * 4 * sum(stage.values()) for stage in parts]
    expected = [Fraction(x) - a + z for x, a, z in zip(plain["sent_bytes_per_rank_by_stage_exact"], plain_dp, zero_dp)]
    assert [Fraction(x) for x in fig["sent_bytes_per_rank_by_stage_exact"]] == expected
    assert Fraction(fig["by_group"]["dp"]["sent_bytes_exact"]) == d * t * sum(zero_dp)
    for g in ("tp", "pp"):
        assert fig["by_group"].get(g) == plain["by_group"].get(g)
    # Each rank holds its padded stage parts' parameters, their gradients (ZeRO-2: 1/d of them) and 1/d of Adam.
    for r in range(p):
        state = combined_model_state_bytes(CFG, dims, r, zero, v)
        assert (state["param_bytes"], state["grad_bytes"], state["optimizer_bytes"]) == (
            4 * padded[r], 4 * padded[r] // (d if zero == 2 else 1), 8 * padded[r] // d)
