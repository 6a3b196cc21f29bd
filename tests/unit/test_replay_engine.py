"""The replay engine (parallel/replay/engine.py) on synthetic programs with known answers, and
every pipeline schedule's lists replayed with the simulator's unit costs: the same idle time."""

from __future__ import annotations

import pytest

from parallel.pp.actions import RECV_B, RECV_F, SEND_B, SEND_F, message, splits_backward
from parallel.pp.schedules import SCHEDULES, build_schedule, schedule_placement
from parallel.pp.simulator import simulate, split_costs
from parallel.replay.engine import Call, Compute, Deadlock, Op, Post, Wait, run
from parallel.replay.virtual import pipeline_figures

PHASE_OF_OP = {"F": "forward", "B": "backward", "W": "weight"}


def test_all_reduce_between_two_ranks_starts_when_the_last_member_posts():
    op = Op(("ar",), (0, 1), "ar", latency_s=0.5, demand={"l0": 10, "l1": 10})
    result = run([[Compute(1), Call(op)], [Compute(3), Call(op)]], {"l0": 10, "l1": 10})
    assert (op.start, op.end) == (3, 4.5)  # the last post at 3, latency 0.5, 10 bytes at 10 B/s
    assert result.ends == [4.5, 4.5]


def test_async_post_overlaps_compute_and_the_wait_blocks_only_for_the_rest():
    op = Op(("ar",), (0, 1), "ar", demand={"l": 4})
    program = [Post(op, "h"), Compute(3), Wait(("h",))]
    result = run([program, list(program)], {"l": 2})  # the transfer takes 2: hidden behind 3 of compute
    assert result.ends == [3, 3]
    slow = Op(("ar2",), (0, 1), demand={"l": 10})
    program = [Post(slow, "h"), Compute(3), Wait(("h",))]
    result = run([program, list(program)], {"l": 2})  # 5 to move: 2 exposed after the compute
    assert result.ends == [5, 5]
    assert [i.end - i.start for i in result.intervals if i.kind == "blocked"] == [2, 2]


def test_p2p_chain_arrives_at_the_later_post_plus_the_transfer():
    a = Op(("m", 0, 1), (0, 1), demand={"01": 2})
    b = Op(("m", 1, 2), (1, 2), demand={"12": 2})
    programs = [[Compute(1), Post(a, "s")], [Call(a), Compute(1), Post(b, "s")], [Compute(0.5), Call(b)]]
    result = run(programs, {"01": 1, "12": 1})
    assert (a.start, a.end, b.start, b.end) == (1, 3, 4, 6)
    assert result.ends == [1, 4, 6]


def test_two_transfers_on_one_link_share_its_bandwidth():
    a, b = Op(("a",), (0, 1), demand={"L": 10}), Op(("b",), (2, 3), demand={"L": 10})
    assert run([[Call(a)], [Call(a)], [Call(b)], [Call(b)]], {"L": 10}).ends == [2, 2, 2, 2]
    c, d = Op(("c",), (0, 1), demand={"L": 10}), Op(("d",), (2, 3), demand={"M": 10})
    assert run([[Call(c)], [Call(c)], [Call(d)], [Call(d)]], {"L": 10, "M": 10}).ends == [1, 1, 1, 1]


def test_a_groups_collectives_run_in_order_and_messages_do_not_queue_behind_them():
    first = Op(("g", 0), (0, 1), demand={"L": 10}, queue=("g",))
    second = Op(("g", 1), (0, 1), demand={"M": 10}, queue=("g",))
    programs = [[Post(first, 1), Post(second, 2), Wait((1, 2))]] * 2
    assert run(programs, {"L": 10, "M": 10}).ends == [2, 2]  # second after first, though on another link


def test_a_group_with_two_lanes_runs_two_collectives_at_once_and_the_third_after_the_first():
    # gloo: two worker threads per group, each with its own connections, taking the posted ops in order
    ops = [Op(("g", k), (0, 1), latency_s=1, demand={"L": 10}, queue=("g",), lanes=2) for k in range(3)]
    programs = [[Post(ops[0], 0), Post(ops[1], 1), Post(ops[2], 2), Wait((0, 1, 2))]] * 2
    result = run(programs, {"L": 10})
    # 0 and 1 wait their latency together, then share L (10 bytes each at 5/s: t = 3); 2 starts then
    assert [(o.start, o.end) for o in result.ops] == [(0, 3), (0, 3), (3, 5)]
    assert result.ends == [5, 5]


def test_a_token_bucket_lets_its_burst_through_at_line_rate_and_the_rest_at_the_rate():
    # rate 10 B/s, a bucket of 20 B passing 1000 B/s: 50 bytes take (50 - 20) / 10 = 3 s, not 5
    op = Op(("m",), (0, 1), demand={"L": 50})
    result = run([[Call(op)], [Call(op)]], {"L": 10}, buckets={"L": (20, 1000)})
    assert result.ends == pytest.approx([3.0, 3.0], abs=1e-9)
    # a transfer within the burst passes at line rate
    small = Op(("s",), (0, 1), demand={"L": 20})
    assert run([[Call(small)], [Call(small)]], {"L": 10}, buckets={"L": (20, 1000)}).ends == pytest.approx([0.02] * 2)


def test_a_token_bucket_refills_at_the_rate_while_the_link_is_idle():
    # 20 B drain the bucket; 1 s of compute refills 10 B of it: the next 20 B take 0.01 + 10/10 s
    first, second = Op(("a",), (0, 1), demand={"L": 20}), Op(("b",), (0, 1), demand={"L": 20})
    programs = [[Call(first), Compute(1.0), Call(second)]] * 2
    ends = run(programs, {"L": 10}, buckets={"L": (20, 1000)}).ends
    # first: 20 B at 1000 B/s, draining at 990 B/s, runs dry after 20/990 s having moved 20.2 B: it is
    # done at 0.02 s with 0.202 B of tokens left; refilled by 10 B in 1 s: 10.2 B at line rate, the
    # rest at 10 B/s
    t1 = 0.02
    tokens = min(20.0, 20 - 990 * t1 + 10 * 1.0)
    burst_time = tokens / 990
    moved = 1000 * burst_time
    assert ends == pytest.approx([t1 + 1.0 + burst_time + (20 - moved) / 10] * 2, rel=1e-9)


def test_processor_sharing_slows_compute_by_cores_over_ranks_computing():
    assert run([[Compute(1)], [Compute(1)]], cores=1).ends == [2, 2]
    assert run([[Compute(1)], [Compute(2)]], cores=1).ends == [2, 3]
    assert run([[Compute(1)]] * 4, cores=2).ends == [2, 2, 2, 2]


def test_processor_sharing_counts_the_members_of_an_op_in_flight():
    # A blocking call on one core: its two members' threads share it, the latency takes twice as long;
    # with a core each it takes its own time.
    def call():
        return Op(("ar",), (0, 1), latency_s=1.0)
    shared_call = call()
    assert run([[Call(shared_call)], [Call(shared_call)]], cores=1).ends == [2, 2]
    own = call()
    assert run([[Call(own)], [Call(own)]], cores=2).ends == [1, 1]
    # Posted, then 1 s of compute on each rank, all on one core: two computing ranks and two
    # members of the op in flight want it, so compute and latency both run at a quarter (4 s);
    # without processor sharing, 1 s each.
    def overlapped():
        op = call()
        return [[Post(op, "h"), Compute(1), Wait(("h",))], [Post(op, "h"), Compute(1), Wait(("h",))]]
    assert run(overlapped(), cores=1).ends == [4, 4]
    assert run(overlapped()).ends == [1, 1]
    # Bytes too: 10 bytes over a 10 B/s link, the two members sharing one core: 2 s.
    moving = Op(("bytes",), (0, 1), demand={"l": 10.0})
    assert run([[Call(moving)], [Call(moving)]], {"l": 10.0}, cores=1).ends == pytest.approx([2, 2])


def test_a_core_per_rank_is_shared_between_its_compute_and_the_measured_cpu_of_its_ops():
    # 4 bytes at 2 B/s: 2 s alone on the link. Rank 0's threads took 1 s of CPU for it (half a core
    # over those 2 s), rank 1's none. Posted, then 3 s of compute on each: rank 0's core is wanted
    # 1.5 times, so its compute and the op go at 2/3 (the op at its slowest member's pace): the op
    # ends at 3, rank 0 has computed 2 s and finishes at 4; rank 1 finishes its compute at 3.
    def programs(cpu):
        op = Op(("ar",), (0, 1), demand={"l": 4}, cpu=cpu)
        return [[Post(op, "h"), Compute(3), Wait(("h",))] for _ in range(2)]
    assert run(programs({0: 1.0, 1: 0.0}), {"l": 2}).ends == pytest.approx([4, 3])
    assert run(programs(None), {"l": 2}).ends == [3, 3]  # not measured: a device's copy engine
    # Blocked in the call, nothing competes with the op: its measured CPU costs no time.
    op = Op(("ar",), (0, 1), demand={"l": 4}, cpu={0: 1.0, 1: 1.0})
    assert run([[Call(op)], [Call(op)]], {"l": 2}).ends == [2, 2]
    # Two ops in flight on a rank want at most its core between them, beside its compute.
    a = Op(("a",), (0, 1), latency_s=1.0, cpu={0: 1.0, 1: 0.0})
    b = Op(("b",), (0, 1), latency_s=1.0, cpu={0: 1.0, 1: 0.0})
    two = [[Post(a, 1), Post(b, 2), Compute(1), Wait((1, 2))] for _ in range(2)]
    assert run(two).ends == pytest.approx([2, 2])  # rank 0 at 1/2: the ops' 1 s of latency takes 2


def test_an_op_lasts_at_least_the_cpu_its_busiest_member_spent_on_it():
    # 4 bytes at 2 B/s after 1 s of latency: 3 s on its links. Rank 0's threads took 5 s of CPU
    # for it: CPU-bound, it lasts 5 s (2 s more latency), and wants rank 0's whole core meanwhile.
    def op(cpu):
        return Op(("ar",), (0, 1), latency_s=1.0, demand={"l": 4}, cpu=cpu)
    busy = op({0: 5.0, 1: 1.0})
    assert run([[Call(busy)], [Call(busy)]], {"l": 2}).ends == pytest.approx([5, 5])
    # Within its links' time the CPU adds nothing; unmeasured, nothing either.
    for cpu in ({0: 3.0, 1: 1.0}, None):
        light = op(cpu)
        assert run([[Call(light)], [Call(light)]], {"l": 2}).ends == pytest.approx([3, 3])
    # Posted beside 2 s of compute: rank 0's core is wanted twice over (the op a whole core), so
    # both go at 1/2 until the compute ends at 4 s, 2 s of the op's 5 done; the rest alone: 7 s.
    posted = op({0: 5.0, 1: 0.0})
    overlapped = [[Post(posted, "h"), Compute(2), Wait(("h",))] for _ in range(2)]
    assert run(overlapped, {"l": 2}).ends == pytest.approx([7, 7])
    # Sharing cores, every member of it in flight wants a core as before: on one core the two
    # members go at 1/2, 10 s.
    shared = op({0: 5.0, 1: 1.0})
    assert run([[Call(shared)], [Call(shared)]], {"l": 2}, cores=1).ends == pytest.approx([10, 10])


def test_shared_cores_count_a_whole_core_for_each_member_of_an_op_in_flight_measured_or_not():
    # The overlapped case of the test before on one core, the op's members having used half a core
    # each: still two computing ranks and two members want it, everything at 1/4: 4 s.
    def overlapped(cpu):
        op = Op(("ar",), (0, 1), latency_s=1.0, cpu=cpu)
        return [[Post(op, "h"), Compute(1), Wait(("h",))] for _ in range(2)]
    assert run(overlapped({0: 0.5, 1: 0.5}), cores=1).ends == [4, 4]
    assert run(overlapped(None), cores=1).ends == [4, 4]


def test_ranks_bound_to_cores_share_only_their_own_core():
    # 4 ranks, 1 s of compute each, two to a core: 2 s; one rank to a core each: 1 s; three on core
    # a and one on core b: 3 s for the three, 1 s for the one, whatever core b leaves idle.
    assert run([[Compute(1)]] * 4, cores=["a", "b", "a", "b"]).ends == [2, 2, 2, 2]
    assert run([[Compute(1)]] * 4, cores=[0, 1, 2, 3]).ends == [1, 1, 1, 1]
    assert run([[Compute(1)]] * 4, cores=["a", "a", "a", "b"]).ends == pytest.approx([3, 3, 3, 1])
    # Uneven work on one core: processor sharing until the shorter ends, then the longer alone.
    assert run([[Compute(1)], [Compute(3)]], cores=[0, 0]).ends == [2, 4]
    with pytest.raises(ValueError, match="core of each of the 2 ranks"):
        run([[Compute(1)], [Compute(1)]], cores=[0])


def test_a_rank_bound_beside_another_shares_its_core_with_that_ranks_ops_as_measured():
    # The test of a core per rank, rank 0's op having taken 1 s of CPU over its 2 s on the link,
    # now with a third rank computing 3 s on rank 0's core: that core is wanted 2.5 times (two
    # computing, half a core for the op), everything on it at 0.4, rank 1's own core at 1.
    # Rank 1 finishes its 3 s of compute at 3; the op has done 1.2 s of its 2 by then, and rank 0
    # and rank 2 1.2 s of their 3; then 0.8 s of the op left at 0.4 (rank 1 blocked wants nothing):
    # it ends at 5, when ranks 0 and 2 have computed 2 s; each has 1 s left at 1/2: 7.
    op = Op(("ar",), (0, 1), demand={"l": 4}, cpu={0: 1.0, 1: 0.0})
    programs = [[Post(op, "h"), Compute(3), Wait(("h",))], [Post(op, "h"), Compute(3), Wait(("h",))], [Compute(3)]]
    assert run(programs, {"l": 2}, cores=[0, 1, 0]).ends == pytest.approx([7, 5, 7])
    # A core per rank is the placement in which none is shared: the same answers as cores=None.
    def alone():
        o = Op(("ar",), (0, 1), demand={"l": 4}, cpu={0: 1.0, 1: 0.0})
        return [[Post(o, "h"), Compute(3), Wait(("h",))] for _ in range(2)]
    assert run(alone(), {"l": 2}, cores=["x", "y"]).ends == pytest.approx(run(alone(), {"l": 2}).ends)


def test_an_op_a_member_never_posts_is_a_deadlock():
    op = Op(("x",), (0, 1))
    with pytest.raises(Deadlock):
        run([[Call(op)], [Compute(1)]])


def _programs(plans, placement, cost, virtual):
    """A schedule's lists as programs, as our executor runs them on the CPU: every receive posted
    at the step's start and waited for at its place in the list, a send posted and never waited
    for; a message arrives `cost.transfer` after its send (the simulator's rules)."""
    split, ops, out = splits_backward(plans), {}, []
    for rank, actions in enumerate(plans):
        receives, program = [], []
        for a in actions:
            if a.op in (SEND_F, SEND_B, RECV_F, RECV_B):
                src, dst, what = message(rank, a, placement)
                op = ops.setdefault(what, Op(what, (src, dst), str(what), "bubble", latency_s=cost.transfer))
                if a.op in (SEND_F, SEND_B):
                    program.append(Post(op, a))
                else:
                    receives.append(Post(op, a))
                    program.append(Wait((a,)))
            else:
                program.append(Compute(cost(a, virtual, split), PHASE_OF_OP[a.op], str(a)))
        out.append(receives + program)
    return out


def _runs(name: str, stages: int, microbatches: int, virtual: int) -> bool:
    try:
        build_schedule(name, stages, microbatches, virtual)
    except ValueError:
        return False
    return True


# Every schedule at every shape it runs at (GPipe and 1F1B take one chunk per rank, ZB-V and
# DualPipeV two): the shapes a schedule refuses are not cases, so nothing here is skipped.
SHAPES = [(name, *shape) for name in sorted(SCHEDULES) for shape in ((4, 8, 1), (4, 8, 2), (2, 4, 1), (3, 6, 2))
          if _runs(name, *shape)]


@pytest.mark.parametrize("transfer", [0.0, 0.25], ids=["free-messages", "messages-take-a-quarter"])
@pytest.mark.parametrize("name,stages,microbatches,virtual", SHAPES)
def test_every_schedule_replays_to_the_simulators_idle_time(name, stages, microbatches, virtual, transfer):
    plans = build_schedule(name, stages, microbatches, virtual)
    placement = schedule_placement(name, stages, virtual)
    cost = split_costs(1, 2, 1 if splits_backward(plans) else 0, transfer=transfer)
    sim = simulate(plans, microbatches, virtual, cost, placement)
    result = run(_programs(plans, placement, cost, virtual))
    assert result.step_s == pytest.approx(sim.makespan, rel=1e-12)
    assert [result.step_s - result.busy(r) for r in range(stages)] == pytest.approx(sim.idle, rel=1e-12)
    # The virtual block's pipeline figures, read off the replay: the simulator's bubble, and the
    # costs it was given per chunk-microbatch.
    figures = pipeline_figures(result, [{"rank": r, "coords": {"pp": r, "dp": 0, "tp": 0}} for r in range(stages)])
    assert figures["bubble"] == pytest.approx(sim.bubble_fraction, rel=1e-12)
    assert figures["mean_forward_s"] == pytest.approx(cost.forward / virtual, rel=1e-12)
    split = splits_backward(plans)
    assert figures["mean_backward_s"] == pytest.approx((cost.input_grad + (0 if split else cost.weight_grad)) / virtual)
    assert figures["mean_weight_s"] == pytest.approx(cost.weight_grad / virtual if split else 0.0)
    # Every stage's own, chunk by chunk: here all alike, so each is the mean.
    assert sorted(figures["by_stage_s"]) == sorted(f"{s}.{c}" for s in range(stages) for c in range(virtual))
    for per in figures["by_stage_s"].values():
        assert (per["F"], per["B"], per["W"]) == pytest.approx(
            (figures["mean_forward_s"], figures["mean_backward_s"], figures["mean_weight_s"]), rel=1e-12)


def test_given_loopback_figures_go_to_a_run_as_overrides_and_come_back_the_same():
    from parallel.replay.probe import figure_overrides, given_figures

    def parsed(overrides):
        return {o.split("=")[0].removeprefix("virtual."): float(o.split("=")[1]) for o in overrides}

    figures = {"bytes_per_s": 1.5e9, "latency_s": 875e-6, "p2p_latency_s": 248e-6}
    back = given_figures(parsed(figure_overrides(figures)))
    assert back == pytest.approx(figures)
    # without a message latency a message costs a ring step; without the rate or latency, nothing is given
    two = {"bytes_per_s": 1.5e9, "latency_s": 875e-6, "p2p_latency_s": None}
    assert len(figure_overrides(two)) == 2 and given_figures(parsed(figure_overrides(two)))["p2p_latency_s"] is None
    assert given_figures({"loopback_gbytes_per_s": None, "loopback_latency_us": 10}) is None
    assert given_figures({"loopback_gbytes_per_s": 1.0, "loopback_latency_us": None}) is None


def test_the_probe_burst_reads_the_cores_l2_and_works_on_twice_that_memory(tmp_path):
    from parallel.replay.probe import FALLBACK_L2_BYTES, burst_side, l2_cache_bytes

    def cache(core, index, level, kind, size):
        index = tmp_path / f"cpu{core}" / "cache" / f"index{index}"
        index.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(f"{value}\n")

    cache(0, 0, 1, "Data", "32K")
    cache(0, 1, 1, "Instruction", "32K")
    cache(0, 2, 2, "Unified", "512K")
    cache(0, 3, 3, "Unified", "32768K")
    cache(1, 0, 2, "Unified", "2M")
    assert l2_cache_bytes(0, tmp_path) == 512 * 2**10
    assert l2_cache_bytes(1, tmp_path) == 2 * 2**20
    assert l2_cache_bytes(7, tmp_path) == FALLBACK_L2_BYTES  # a core sysfs does not describe
    for l2 in (256 * 2**10, 512 * 2**10, 2**20, 1280 * 2**10, 2 * 2**20):
        side = burst_side(l2)
        # a @ a reads side^2 fp32 numbers and writes side^2: at least twice the L2, by under a step of 32
        assert side % 32 == 0 and 2 * side * side * 4 >= 2 * l2 > 2 * (side - 32) ** 2 * 4
    assert burst_side(512 * 2**10) == 384


def test_the_probe_times_a_call_from_the_later_of_the_two_posts():
    """Known answers: rank 1 posts 300 µs after rank 0 and both end 200 µs after that, so the call
    took 200 µs from its last post (a rank's own time, 500 µs, holds its wait for the other);
    a ping-pong's round trip ends at the first member's end."""
    import torch

    from parallel.replay.probe import from_last_post

    first = torch.tensor([[1.0000, 1.0005], [2.0003, 2.0005]], dtype=torch.float64)
    second = torch.tensor([[1.0003, 1.0005], [2.0000, 2.0005]], dtype=torch.float64)
    assert from_last_post([first, second]) == pytest.approx(200e-6, abs=1e-9)
    # ends apart: the collective's end is the two ends' mean; the ping-pong's the first member's
    second_late_end = torch.tensor([[1.0003, 1.0007], [2.0000, 2.0007]], dtype=torch.float64)
    assert from_last_post([first, second_late_end]) == pytest.approx(300e-6, abs=1e-9)
    assert from_last_post([first, second_late_end], end_of="first") == pytest.approx(200e-6, abs=1e-9)


def test_the_probe_stops_its_payload_calls_once_their_mean_is_known_well_enough():
    """Known answers for `known_well_enough` (PRECISION of the bytes' time, 5%): three payload calls
    of 5 ms +-0.1 ms beside small calls of 0.2 ms with a 0.1 ms spread are enough (standard error
    0.06 ms against 5% of 4.8 ms); the same three beside small calls that spread by 1 ms are not
    (a payload call makes their handoffs, so its spread is taken as at least theirs), nor three
    that spread by 2 ms themselves, nor calls no longer than the small ones."""
    import torch

    from parallel.replay.probe import PRECISION, known_well_enough

    assert PRECISION == 0.05
    payload = torch.tensor([5.0e-3, 5.1e-3, 4.9e-3], dtype=torch.float64)
    quiet = 0.2e-3 + 0.1e-3 * torch.tensor([-1.0, 1.0] * 60, dtype=torch.float64)
    busy = 0.2e-3 + 1e-3 * torch.tensor([-1.0, 1.0] * 60, dtype=torch.float64)
    assert known_well_enough(payload, quiet)
    assert not known_well_enough(payload, busy)
    assert not known_well_enough(torch.tensor([3e-3, 5e-3, 7e-3], dtype=torch.float64), quiet)
    assert not known_well_enough(torch.full((3,), 0.2e-3, dtype=torch.float64), quiet)


def test_a_periodic_strategys_replayed_step_is_the_mean_over_its_whole_periods():
    """DiLoCo syncs once per H steps: its replayed figure is the mean over the last whole periods of the
    steps saved (each holds one sync), not the median step, which would leave every sync out."""
    from parallel.replay.virtual import mean_steps

    assert mean_steps(5, 1) == [] and mean_steps(3, 4) == []
    assert mean_steps(5, 2) == [1, 2, 3, 4] and mean_steps(6, 3) == [0, 1, 2, 3, 4, 5]
