"""`train.pin_cores` (parallel/dist/binding.py): which block of cores each rank of a machine takes,
when it takes none, and that binding moves every thread of the process, earlier and later ones.

What binding buys is a timing (docs/core-binding.md); these tests check what can be
checked exactly, in this process, binding nothing (tests/runs/test_core_binding.py binds, in child
processes).
"""

import os

import pytest

from parallel.dist.binding import (
    HOST_CORES_ENV,
    allowed_cores,
    bind_rank,
    cores_for,
    host_cores,
    round_robin_cores,
    slot_on_machine,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"),
                                reason="binding threads to cores is Linux's")


def test_slot_on_machine_counts_only_the_ranks_of_this_machine():
    ids = ["a", "b", "a", "b", "a"]  # ranks 0, 2, 4 on machine a; 1, 3 on b
    assert slot_on_machine(ids, 0) == (0, 3)
    assert slot_on_machine(ids, 4) == (2, 3)
    assert slot_on_machine(ids, 3) == (1, 2)
    assert slot_on_machine(["a"], 0) == (0, 1)


def test_cores_for_gives_each_rank_its_own_block_or_none():
    assert cores_for(0, 2, [4, 5, 6, 7], 2) == [4, 5]
    assert cores_for(1, 2, [4, 5, 6, 7], 2) == [6, 7]
    assert cores_for(2, 3, [0, 1, 2, 3], 1) == [2]  # a core left over stays unused
    assert cores_for(0, 3, [0, 1], 1) is None  # more ranks than cores
    assert cores_for(0, 2, [0, 1, 2], 2) is None  # 2 ranks x 2 threads on 3 cores


def test_round_robin_deals_the_cores_in_turn_however_many_ranks():
    assert [round_robin_cores(slot, [0, 1], 1) for slot in range(4)] == [[0], [1], [0], [1]]
    assert [round_robin_cores(slot, [4, 5, 6], 1) for slot in range(4)] == [[4], [5], [6], [4]]
    assert round_robin_cores(1, [0, 1, 2, 3], 2) == [2, 3]
    assert round_robin_cores(1, [0, 1, 2], 2) == [0, 2]  # the block wraps around
    assert round_robin_cores(0, [0, 1], 3) == [0, 1]  # more threads than cores: every core once


def test_nothing_is_bound_where_the_rule_says_not():
    """Each of these returns what it did not do and leaves this process's cores as they were."""
    before = os.sched_getaffinity(0)
    n = len(allowed_cores())
    too_many = ["m"] * (n + 1)
    assert bind_rank("off", ["m", "m"], 0, 1, "cpu").startswith("off (the 2 rank(s) of this machine share its")
    assert bind_rank("auto", too_many, 0, 1, "cpu") == (
        f"not bound: {n + 1} ranks with 1 thread(s) each share {n} core(s) (the contention the virtual clock "
        "replays away)")
    assert bind_rank("auto", ["m", "m"], 0, 1, "cuda") == "not bound (a GPU run: the device computes, not the cores)"
    assert bind_rank("auto", ["m"], 0, n, "cpu") == f"not bound (the one rank of this machine has all its {n} core(s))"
    assert bind_rank("round_robin", too_many, 0, n, "cpu") == (
        f"not bound (rank 0 of this machine's {n + 1} would take all its {n} core(s))")
    assert bind_rank("round_robin", too_many, 0, 1, "cuda").startswith("not bound (a GPU run")
    assert os.sched_getaffinity(0) == before
    assert HOST_CORES_ENV not in os.environ


def test_a_bad_choice_is_named():
    with pytest.raises(ValueError, match=r"train.pin_cores='always': choose one of auto, off, round_robin"):
        bind_rank("always", ["m"], 0, 1, "cpu")


def test_host_cores_without_binding_is_the_affinity():
    assert host_cores() == len(os.sched_getaffinity(0))
