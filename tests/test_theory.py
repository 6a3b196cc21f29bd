"""theory.py against the formulas of REFERENCES.md, written out here a second time."""

from fractions import Fraction

import pytest

from parallel.comm import ring_bytes_sent
from parallel.dims import ParallelDims
from parallel.model import GPTConfig
from parallel.theory import expected_comm, parameter_count

CFG = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_bytes_table(n):
    S = 1000
    # REFERENCES.md, "bytes one rank sends in a bandwidth-optimal (ring) algorithm"
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
    with pytest.raises(ValueError, match="no formula"):
        expected_comm("carrier_pigeon", CFG, ParallelDims.resolve(2))
