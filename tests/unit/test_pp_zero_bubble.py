"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) as data, checked by the simulator.

For every schedule, p <= 8 and m <= 16 wherever the schedule accepts (p, m), and F, B, W times
given separately: the lists finish without deadlock; every microbatch runs F, then B, then W
exactly once on every virtual stage (the simulator raises otherwise); each rank's idle time equals
the closed form of its record (pp/schedules.py) exactly (Fractions), every term of each form being the longest somewhere
in the grid; the activations held per rank equal the stated count and stay within the paper's
bound. The orders equal PyTorch 2.13's own schedules'. Then the placement, the traffic formulas
against the sends in the lists, and the orders of small cases written out. No processes. What
the rest of the system makes of these schedules: test_pp_zero_bubble_plan.py.
"""

from collections import Counter
from fractions import Fraction as Fr
from itertools import pairwise
from types import SimpleNamespace

import pytest

from parallel.core.model import GPTConfig
from parallel.pp.actions import RECV_F, SEND_B, SEND_F, Action, B, F, W
from parallel.pp.placement import Placement
from parallel.pp.schedules import (
    ScheduleError,
    build_schedule,
    closed_form_bubble,
    closed_form_idle,
    compute_only,
    has_closed_form,
    idle_terms,
    schedule_placement,
)
from parallel.pp.simulator import ScheduleInvalid, simulate, simulate_schedule, split_costs
from parallel.pp.theory import pipeline_p2p_bytes

VIRTUAL = {"gpipe": 1, "1f1b": 1, "zbh1": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}
GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]

# Whole-share (F, B, W) times, even integers so that a V chunk's halves stay integers and the
# simulator's float arithmetic is exact: equal times, then ones under which each term of the closed
# forms is the longest chain (found by searching costs; test_every_term_is_the_longest_somewhere
# proves they are).
EQUAL, UNEQUAL = (4, 4, 4), (6, 10, 4)
TERM_COSTS = [(58, 62, 50), (4, 50, 56), (34, 16, 64), (56, 4, 68), (18, 74, 10), (78, 2, 58), (72, 48, 12),
              (74, 72, 26), (66, 30, 2), (50, 24, 20), (8, 4, 12)]
SCHEDULES = ["zbh1", "zbv", "dualpipev", "gpipe", "1f1b", "interleaved_1f1b"]


def plans_if_allowed(schedule, p, m):
    try:
        return build_schedule(schedule, p, m, VIRTUAL[schedule])
    except ScheduleError:
        return None


def expected_peaks(schedule, p, m):
    """Chunk-microbatches held at once (F done, backward not complete), per rank."""
    return {
        "gpipe": [m] * p,
        "1f1b": [min(p - r, m) for r in range(p)],
        "zbh1": [min(p, m)] * p,                               # 1F1B's first rank, on every rank
        "zbv": [min(2 * p, 2 * m, m + r + 1) for r in range(p)],
        "dualpipev": [2 * p + 1] * p,
    }[schedule]


# What each paper states, in chunk-microbatches: 1F1B's p microbatches (2p chunks of a V rank) for
# ZB-H1 and ZB-V (Qi et al. 2023 §3.1, §6); DualPipe's PP + 1 with PP = 2p stages (DeepSeek-V3 Table 2).
PAPER_BOUND = {"zbh1": lambda p: p, "zbv": lambda p: 2 * p, "dualpipev": lambda p: 2 * p + 1}


def check_against_closed_form(schedule, p, m, plans, costs):
    """Simulate (which raises on a deadlock or any F/B/W out of order, missing or repeated) and
    compare every rank's idle time with the closed form. Returns the simulation."""
    v = VIRTUAL[schedule]
    result = simulate(plans, m, v, split_costs(*costs), schedule_placement(schedule, p, v))
    if has_closed_form(schedule, p, m):
        idle = closed_form_idle(schedule, p, m, v, *costs)
        assert result.idle == [idle] * p, (schedule, p, m, costs)
        assert result.bubble_exact == closed_form_bubble(schedule, p, m, v, *costs)
    else:
        assert closed_form_bubble(schedule, p, m, v, *costs) is None
        assert min(result.idle) >= (p - 1) * costs[0] / v  # the last rank starts (p-1) forwards late
    return result


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_finishes_holds_and_matches_the_closed_form(schedule):
    v, checked = VIRTUAL[schedule], 0
    for p, m in GRID:
        plans = plans_if_allowed(schedule, p, m)
        if plans is None:
            continue
        for costs in (EQUAL, UNEQUAL):
            result = check_against_closed_form(schedule, p, m, plans, costs)
        if schedule == "interleaved_1f1b":  # Megatron's warm-up bounds the first rank
            assert result.peak_activations[0] <= min(2 * (p - 1) + (v - 1) * p + 1, m * v)
        else:
            assert result.peak_activations == expected_peaks(schedule, p, m), (p, m)
        if schedule in PAPER_BOUND:
            assert max(result.peak_activations) <= PAPER_BOUND[schedule](p)
        checked += has_closed_form(schedule, p, m)
    assert checked == {"zbv": 72, "dualpipev": 64, "interleaved_1f1b": 42}.get(schedule, 128)  # the (p, m) with a form


@pytest.mark.parametrize("schedule", ["zbh1", "zbv", "dualpipev"])
def test_every_term_is_the_longest_somewhere(schedule):
    """Each term of the closed form is the only longest chain for some tested (p, m, costs): none is
    dead weight, and none is left unchecked by the test above."""
    v, longest = VIRTUAL[schedule], Counter()
    for p in (2, 3, 4, 8):
        for m in {"zbh1": (2, p, 16), "zbv": (2 * p - 1, 16), "dualpipev": (2 * p, 16)}[schedule]:
            plans = build_schedule(schedule, p, m, v)
            for costs in [EQUAL, UNEQUAL, *TERM_COSTS]:
                check_against_closed_form(schedule, p, m, plans, costs)
                terms = idle_terms(schedule, p, m, v, *costs)
                if terms.count(max(terms)) == 1:
                    longest[terms.index(max(terms))] += 1
    assert sorted(longest) == list(range(len(idle_terms(schedule, 4, 16, v, *EQUAL)))), longest


def test_zb_h1_is_qi_form_when_w_is_smallest():
    # Qi et al. 2023 §3.1: (p-1)(F+B-W), for m >= p, with W no larger than F or B.
    for p, m in [(4, 4), (4, 8), (8, 16), (2, 3)]:
        for F_, B_, W_ in [(1, 1, 1), (3, 2, 1), (2, 5, 2)]:
            result = simulate_schedule("zbh1", p, m, 1, split_costs(Fr(F_), Fr(B_), Fr(W_)))
            assert result.idle[0] == (p - 1) * (F_ + B_ - W_)
            # ... which is 1F1B's (p-1)(F+B+W) less 2(p-1)W, at 1F1B's peak memory
            one_f_one_b = simulate_schedule("1f1b", p, m, 1, split_costs(Fr(F_), Fr(B_), Fr(W_)))
            assert one_f_one_b.idle[0] - result.idle[0] == 2 * (p - 1) * W_
            assert max(result.peak_activations) == max(one_f_one_b.peak_activations)


def test_v_schedules_halve_zb_h1_idle_at_equal_times():
    # f = b = w: ZB-V and DualPipeV idle (p-1)f = (p-1)F/2, ZB-H1 (p-1)F.
    for p in (2, 4, 8):
        costs = split_costs(2, 2, 2)
        assert simulate_schedule("zbh1", p, 2 * p, 1, costs).idle[0] == 2 * (p - 1)
        assert simulate_schedule("zbv", p, 2 * p, 2, costs).idle[0] == p - 1
        assert simulate_schedule("dualpipev", p, 2 * p, 2, costs).idle[0] == p - 1


def test_critical_path_explains_the_makespan():
    for schedule, m in [("zbh1", 6), ("zbv", 7), ("dualpipev", 8), ("interleaved_1f1b", 8)]:
        result = simulate_schedule(schedule, 4, m, VIRTUAL[schedule], split_costs(Fr(9), Fr(6), Fr(3, 2)))
        chain = result.critical_path()
        assert chain[0].start == 0 and chain[-1].end == result.makespan
        assert all(a.end == b.start for a, b in pairwise(chain))
    # ZB-H1, F large: the first forward wave, the last rank's run, the last gradient wave up, rank 0's W.
    result = simulate_schedule("zbh1", 4, 6, 1, split_costs(Fr(9), Fr(6), Fr(3, 2)))
    chain = [f"r{s.rank}:{s.action}" for s in result.critical_path() if s.action.op in (F, B, W)]
    assert chain[:4] == ["r0:F0", "r1:F0", "r2:F0", "r3:F0"]
    assert chain[-5:] == ["r3:B5", "r2:B5", "r1:B5", "r0:B5", "r0:W5"]


# -- orders written out ----------------------------------------------------------------------------

def orders(schedule, p, m):
    plans = build_schedule(schedule, p, m, VIRTUAL[schedule])
    return [" ".join(str(a) for a in compute_only(actions)) for actions in plans]


def test_zb_h1_order_on_four_stages():
    # 1F1B's F and B order; rank r runs each W r steps after its B, the rest after the last B.
    assert orders("zbh1", 4, 4) == [
        "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3",
        "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3",
        "F0 F1 B0 F2 B1 F3 B2 W0 B3 W1 W2 W3",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3",
    ]


def test_zb_v_order_on_two_ranks():
    # Rank 0 holds stages 0 and 3 (chunk .1: the last stage, with the loss); rank 1 stages 1 and 2.
    assert orders("zbv", 2, 4) == [
        "F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3 B0 W0 F2.1 B2.1 W2.1 B1 W1 F3.1 B3.1 W3.1 B2 W2 B3 W3",
        "F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 F3 B1 W1 F3.1 B2.1 W2.1 B2 B3.1 B3 W2 W3.1 W3",
    ]


def test_dualpipe_v_order_on_two_ranks():
    assert orders("dualpipev", 2, 4) == [
        "F0 F1 F2 F0.1 B0.1 W0.1 F1.1 F3 B1.1 W1.1 F2.1 B0 W0 B2.1 W2.1 F3.1 B1 W1 B3.1 W3.1 B2 W2 B3 W3",
        "F0 F0.1 F1 F1.1 F2 B0.1 W0.1 F2.1 B0 W0 F3 B1.1 W1.1 F3.1 B1 W1 B2.1 W2.1 B2 W2 B3.1 B3 W3.1 W3",
    ]


def torch_orders(cls, p, m, **attrs):
    """PyTorch 2.13's compute order per rank, from the pure per-rank planner its schedules call in
    their constructor (private API: run on a stand-in object, no process group), in our vocabulary:
    FULL_BACKWARD = B then W, OVERLAP_F_B = its F then its whole backward, one after the other."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    place = Placement(p, 2, "v") if cls.__name__ != "ScheduleInterleavedZeroBubble" else Placement(p)
    ops = {T.FORWARD: [F], T.BACKWARD_INPUT: [B], T.BACKWARD_WEIGHT: [W], T.FULL_BACKWARD: [B, W]}
    planner = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p, **attrs)
    orders = []
    for rank in range(p):
        flat = []
        for a in filter(None, cls._calculate_single_rank_operations(planner, rank)):
            flat += a.sub_actions if a.computation_type == T.OVERLAP_F_B else [a]
        orders.append([Action(op, a.microbatch_index, place.location(a.stage_index)[1])
                       for a in flat for op in ops[a.computation_type]])
    return orders


def test_orders_are_pytorchs():
    """zbv and dualpipev are ScheduleZBVZeroBubble's and ScheduleDualPipeV's orders, and zbh1 is
    ScheduleInterleavedZeroBubble's with one stage per rank, wherever PyTorch accepts (p, m)."""
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    def ours(schedule, p, m):
        return [compute_only(actions) for actions in build_schedule(schedule, p, m, VIRTUAL[schedule])]

    for p, m in GRID:
        assert ours("zbv", p, m) == torch_orders(ScheduleZBVZeroBubble, p, m)
        if m >= 2 * p:  # PyTorch refuses fewer, as we do
            assert ours("dualpipev", p, m) == torch_orders(ScheduleDualPipeV, p, m)
        rounds = max(1, m // p)
        if m % rounds == 0:  # PyTorch refuses other m (e.g. odd m >= 5 at p = 2)
            assert ours("zbh1", p, m) == torch_orders(ScheduleInterleavedZeroBubble, p, m, n_local_stages=1,
                                                      microbatches_per_round=m // rounds)


def test_the_turn_of_the_v_sends_nothing():
    turn = build_schedule("zbv", 2, 3, 2)[1]  # rank p-1 holds stages p-1 and p
    assert [str(a) for a in turn[:4]] == ["RECV_F0", "F0", "F0.1", "SEND_F0.1"]  # F0 -> F0.1 stays on the rank
    rank0 = build_schedule("zbv", 2, 3, 2)[0]
    assert Action(RECV_F, 0, 1) in rank0 and Action(SEND_F, 0, 1) not in rank0  # the last stage sends no output
    assert Action(SEND_B, 0, 0) not in rank0  # ... and the first stage no input gradient


# -- placement ---------------------------------------------------------------------------------------

def test_placement_v_and_loop():
    v = Placement(4, 2, "v")
    assert [v.vstages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(v.vstage(*v.location(s)) == s for s in range(8))
    assert v.crossings() == 6 and not v.crosses(3)  # 2(p-1): the turn 3 -> 4 is inside rank 3
    loop = Placement(4, 2)
    assert [loop.vstages_of(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert loop.crossings() == 7
    assert schedule_placement("zbv", 4, 2) == v and schedule_placement("dualpipev", 4, 2) == v
    assert schedule_placement("zbh1", 4) == Placement(4, 1) and schedule_placement("interleaved_1f1b", 4, 2) == loop


# -- traffic -------------------------------------------------------------------------------------

def sends_in_lists(schedule, p, m, v):
    """(sender, receiver) -> number of sends, read from the action lists themselves."""
    place = schedule_placement(schedule, p, v)
    links = Counter()
    for rank, actions in enumerate(build_schedule(schedule, p, m, v)):
        for a in actions:
            if a.op in (SEND_F, SEND_B):
                vs = place.vstage(rank, a.chunk)
                links[rank, place.rank_of(vs + 1 if a.op == SEND_F else vs - 1)] += 1
    return links


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbh1", "zbv", "dualpipev"])
def test_traffic_equals_the_sends_in_the_lists(schedule):
    from parallel.pp.theory import (
        boundary_bytes,
        p2p_bytes_per_step,
        p2p_links,
        p2p_sent_by_rank,
    )

    v = VIRTUAL[schedule]
    act = boundary_bytes(2, 32, 64, 4)
    assert act == 2 * 32 * 64 * 4
    for p, m in [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)]:
        if plans_if_allowed(schedule, p, m) is None:
            continue
        lists = sends_in_lists(schedule, p, m, v)
        assert p2p_links(schedule, p, m, v, act) == {k: n * act for k, n in lists.items()}
        assert p2p_bytes_per_step(schedule, p, m, v, act) == sum(lists.values()) * act
        assert sum(p2p_sent_by_rank(schedule, p, m, v, act)) == p2p_bytes_per_step(schedule, p, m, v, act)
        crossings = 2 * (p - 1) if schedule in ("zbv", "dualpipev") else v * p - 1
        assert p2p_bytes_per_step(schedule, p, m, v, act) == 2 * m * crossings * act
        if schedule not in ("zbv", "dualpipev"):  # the loop placement: the existing theory's figure
            cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=8, n_heads=4)
            assert p2p_bytes_per_step(schedule, p, m, v, act) == pipeline_p2p_bytes(cfg, 2, m, p, v)


def test_v_traffic_by_rank():
    from parallel.pp.theory import p2p_sent_by_rank

    # The ends talk on one link per arm, the inner ranks on two: each inner rank sends twice as much.
    assert p2p_sent_by_rank("zbv", 4, 8, 2, 1) == [16, 32, 32, 16]
    assert p2p_sent_by_rank("1f1b", 4, 8, 1, 1) == [8, 16, 16, 8]


# -- refusals and the simulator's own checks ----------------------------------------------------------

@pytest.mark.parametrize("schedule,p,m,v,message", [
    ("zbv", 2, 4, 1, r"parallel.virtual_stages=1: zbv runs exactly two chunks per rank in a V; set parallel"),
    ("dualpipev", 4, 8, 3, r"parallel.virtual_stages=3: dualpipev runs exactly two chunks"),
    ("dualpipev", 4, 7, 2, r"parallel.microbatches=7: dualpipev needs at least 2 x parallel.pp = 8 microbatches"),
    ("zbh1", 2, 4, 2, r"parallel.virtual_stages=2: zbh1 runs one chunk per rank"),
    ("zbh1", 2, 0, 1, r"parallel.microbatches=0 must be a positive integer"),
])
def test_refusals_name_the_value_and_the_fix(schedule, p, m, v, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(schedule, p, m, v)


def test_simulator_catches_w_before_b_and_a_missing_w():
    plans = build_schedule("zbh1", 2, 2, 1)
    swapped = [list(plans[0]), plans[1]]
    i, j = swapped[0].index(Action(B, 0)), swapped[0].index(Action(W, 0))
    swapped[0][i], swapped[0][j] = swapped[0][j], swapped[0][i]
    with pytest.raises(ScheduleInvalid, match="before the B"):
        simulate(swapped, 2)
    missing = [[a for a in plans[0] if a != Action(W, 1)], plans[1]]
    with pytest.raises(ScheduleInvalid, match="ran W 0 times"):
        simulate(missing, 2)


def test_simulator_holds_activations_until_w():
    def peak(order: str) -> int:
        actions = [Action(text[0], int(text[1])) for text in order.split()]
        return simulate([actions], 2).peak_activations[0]

    assert peak("F0 B0 W0 F1 B1 W1") == 1
    assert peak("F0 F1 B0 B1 W0 W1") == 2
    assert peak("F0 B0 F1 B1 W0 W1") == 2  # B frees nothing when W follows: held until W


def test_receives_follow_the_senders_order():
    """Two ranks' messages are matched in posting order. On the V a rank may need a later message
    of its neighbour first: the lists post the earlier ones with it, and the simulator refuses lists
    that do not (here: each receive put right before its compute, as with_comm alone does)."""
    from parallel.pp.actions import in_send_order, with_comm

    place = schedule_placement("zbv", 2, 2)
    plans = build_schedule("zbv", 2, 4, 2)
    naive = [with_comm(compute_only(actions), r, place) for r, actions in enumerate(plans)]
    assert naive != plans and in_send_order(naive, place) == plans
    with pytest.raises(ScheduleInvalid, match="messages between two ranks arrive in the order sent"):
        simulate(naive, 4, 2, placement=place)
    # The schedules on the loop need no reordering: each pair of ranks talks one way per direction.
    for schedule, v in [("1f1b", 1), ("zbh1", 1), ("interleaved_1f1b", 2)]:
        lists = build_schedule(schedule, 4, 8, v)
        assert in_send_order(lists, schedule_placement(schedule, 4, v)) == lists
