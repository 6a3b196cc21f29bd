"""The pipeline's sends and receives as the executor posts them, played under gloo's and NCCL's rules.

* The posting the executor first used on GPUs (each run of consecutive sends and receives one
  batch_isend_irecv on the one pipeline group) forms a cycle under NCCL's rules for interleaved
  1F1B at p 2, m 4: rank 0's first backward send waits for a receive that rank 1 would post after a
  group that needs a receive of rank 0's queued behind that very send. Under gloo's rules the same
  posting finishes, which is why no CPU run ever met it.
* Every shipped schedule, at every p in {2, 3, 4, 8}, m up to 16 and the virtual stages it takes
  (the presets' and the tests' sizes among them), finishes as the executor posts it on each
  backend: gloo's posting under gloo's rules, NCCL's posting under NCCL's and (the CPU tests' way
  of reaching it) under gloo's.
* The posting plans are what the executor walks: each keeps the list's order of sends (where
  posted) and receives (where waited for), posts every receive before the step's first compute,
  and NCCL's posts each op alone on the link of its direction.
* The run validator refuses, before any process group, a registered schedule whose lists would
  hang, naming the schedule, p, m and the first cycle; and gloo's posting on NCCL, whose one group
  of every receive would hang every schedule.
No processes.
"""

import pytest
import yaml
from launcher import PROJECT_ROOT
from test_pp_zero_bubble_plan import plan_error

from parallel.pp.actions import Action, B, F
from parallel.pp.placement import Placement
from parallel.pp.posting import RECEIVES, SENDS, Link, Post, Wait, pipeline_links, posting_plans
from parallel.pp.progress import schedule_deadlock
from parallel.pp.schedules import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    build_schedule,
    register_schedule,
    schedule_placement,
    unregister_schedule,
    with_comm,
)
from parallel.pp.simulator import ScheduleInvalid, simulate_schedule

STAGES, MICROBATCHES = (2, 3, 4, 8), range(1, 17)
VIRTUAL = {"interleaved_1f1b": (1, 2, 4), "zbv": (2,), "dualpipev": (2,)}  # the others: 1


def layouts():
    """Every (schedule, p, m, v) of the grid the schedule accepts."""
    for name in SCHEDULES:
        for p in STAGES:
            for m in MICROBATCHES:
                for v in VIRTUAL.get(name, (1,)):
                    try:
                        build_schedule(name, p, m, v)
                    except ScheduleError:
                        continue
                    yield name, p, m, v


def test_the_first_gpu_posting_cycles_under_nccl_for_interleaved_at_p2_m4():
    cycle = schedule_deadlock("interleaved_1f1b", 2, 4, 2, "runs", "nccl")
    assert cycle is not None and cycle.ranks == [0, 1]
    assert cycle.blocked == ["rank 0 SEND_B0.1", "rank 1 SEND_B1.1", "rank 0 RECV_B1.1"]
    assert "rank 0 RECV_B1.1 is queued behind SEND_B0.1 on the same communicator" in str(cycle)
    with pytest.raises(ScheduleInvalid, match=r"deadlock with the runs posting: a cycle under nccl's rules: "
                                              r"rank 0 SEND_B0\.1 needs rank 1 to post the matching receive"):
        simulate_schedule("interleaved_1f1b", 2, 4, 2, posting="runs", rules="nccl")
    assert schedule_deadlock("interleaved_1f1b", 2, 4, 2, "runs", "gloo") is None


def test_every_schedule_finishes_as_the_executor_posts_it_on_each_backend():
    checked, cycled_before = 0, set()
    for name, p, m, v in layouts():
        for posting, rules in (("nccl", "nccl"), ("gloo", "gloo"), ("nccl", "gloo")):
            assert schedule_deadlock(name, p, m, v, posting, rules) is None, (name, p, m, v, posting, rules)
        if schedule_deadlock(name, p, m, v, "runs", "nccl") is not None:
            cycled_before.add(name)
        checked += 1
    assert checked > 300
    # The first GPU posting hung the schedules whose ranks both send and receive between the same
    # two ranks at once (the interleaved loop's wrap-around, the V); gpipe, 1f1b and zbh1 never.
    assert cycled_before == {"interleaved_1f1b", "zbv", "dualpipev"}


def test_the_grid_holds_every_preset():
    """Every pipeline preset's schedule, chunk count and microbatches are in the grid (the run tests
    use p 2 and 4, m 2 to 8: inside it too)."""
    presets = [yaml.safe_load(path.read_text()) for path in (PROJECT_ROOT / "conf" / "parallel").glob("*.yaml")]
    scheduled = [c for c in presets if c.get("schedule")]
    assert scheduled and all(c["microbatches"] in MICROBATCHES for c in scheduled)
    assert all(c["schedule"] in SCHEDULES and c.get("virtual_stages", 1) in VIRTUAL.get(c["schedule"], (1,))
               for c in scheduled)


@pytest.mark.parametrize("posting", ["gloo", "nccl", "runs"])
@pytest.mark.parametrize("name", ["interleaved_1f1b", "dualpipev"])
def test_a_posting_keeps_the_lists_order(name, posting):
    p, m, v = 4, 8, 2
    placement = schedule_placement(name, p, v)
    plans = build_schedule(name, p, m, v)
    for rank, steps in enumerate(posting_plans(posting, plans, placement)):
        reached = []
        for step in steps:
            if isinstance(step, Post):
                reached += [a for a in step.actions if a.op in SENDS]
            elif isinstance(step, Wait):
                reached += [a for a in step.actions if a.op in RECEIVES]
            else:
                reached.append(step)
        assert reached == plans[rank]
        posts = [s for s in steps if isinstance(s, Post)]
        if posting == "nccl":
            assert all(len(s.actions) == 1 and isinstance(s.channel, Link) for s in posts)
            assert {s.channel for s in posts} <= set(pipeline_links(placement))
        else:
            assert all(s.channel is None for s in posts)
        if posting != "runs":  # every receive posted before the first compute
            first = next(k for k, s in enumerate(steps) if not isinstance(s, (Post, Wait)))
            early = [a for s in steps[:first] if isinstance(s, Post) for a in s.actions]
            assert set(early) == {a for a in plans[rank] if a.op in RECEIVES}


def test_links_are_both_directions_of_every_neighbour_pair():
    assert pipeline_links(Placement(4, 1)) == [Link(0, 1), Link(1, 0), Link(1, 2), Link(2, 1), Link(2, 3), Link(3, 2)]
    assert len(pipeline_links(Placement(4, 2))) == 8  # the loop wraps around: 3 -> 0 and back
    assert pipeline_links(Placement(2, 2, "v")) == [Link(0, 1), Link(1, 0)]


def first_rank_waits(stages: int, microbatches: int, virtual: int = 1):
    """Rank 0 wants each microbatch's gradient back before it sends the next forward, while every
    other rank runs all its forwards first: rank 0 waits for rank 1's B0, rank 1 for rank 0's F1."""
    plans = []
    for rank in range(stages):
        if rank == 0:
            compute = [Action(op, mb) for mb in range(microbatches) for op in (F, B)]
        else:
            compute = [Action(op, mb) for op in (F, B) for mb in range(microbatches)]
        plans.append(with_comm(compute, rank, Placement(stages, 1)))
    return plans


@pytest.fixture
def hanging_schedule():
    register_schedule(Schedule("first_rank_waits", first_rank_waits))
    yield "first_rank_waits"
    unregister_schedule("first_rank_waits")


@pytest.mark.parametrize("posting", ["auto", "nccl"])
def test_a_registered_schedule_that_would_hang_is_refused_with_its_first_cycle(hanging_schedule, posting):
    error = plan_error(2, "parallel=pp_gpipe", f"parallel.schedule={hanging_schedule}", "parallel.microbatches=2",
                       f"parallel.pp_posting={posting}")
    assert error.startswith(f"parallel.schedule={hanging_schedule} at parallel.pp=2, parallel.microbatches=2 "
                            "cannot run on gloo as the pipeline executor posts it"), error
    assert ("a cycle under gloo's rules: rank 0 RECV_B0 needs rank 1 to post the matching send, but rank 1 is "
            "blocked waiting for RECV_F1; rank 1 RECV_F1 needs rank 0 to post the matching send, but rank 0 is "
            "blocked waiting for RECV_B0") in error
    assert "\n" not in error


def test_gloo_posting_on_nccl_is_refused():
    """One batch of every receive of the step is one NCCL group: the first wait waits for all of them."""
    from hydra import compose, initialize_config_dir

    from parallel.dist.groups import LaunchEnv
    from parallel.run_plan import ConfigError, build_plan

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", "parallel=pp_1f1b", "parallel.backend=nccl",
                                                       "parallel.pp_posting=gloo"])
    env = LaunchEnv(rank=0, world_size=2, local_world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.schedule=1f1b at parallel.pp=2, parallel.microbatches=4 cannot "
                                          r"run on nccl as the pipeline executor posts it \(gloo posting\)"):
        build_plan(cfg, env, cuda_available=True)
    cfg.parallel.pp_posting = "auto"
    assert build_plan(cfg, env, cuda_available=True).backend == "nccl"


def test_pytorchs_pipelines_take_no_posting():
    error = plan_error(2, "parallel=torch_pp_1f1b", "parallel.pp_posting=nccl")
    assert "parallel.pp_posting=nccl chooses how this project's pipeline executor posts" in error



def test_the_planners_search_replays_the_posting_only_of_the_rows_that_fit():
    """The search asks build_plan without replaying a pipeline's posting (`replay_schedule=False`) and
    plays it on the rows that fit (`posting_refusal`, the same rule a run meets): gloo's posting on nccl
    is accepted unplayed, then refused as a run refuses it, counted by its rule; a row that does not fit
    is not played and says so."""
    from collections import Counter

    from hydra import compose, initialize_config_dir

    from parallel.dist.groups import LaunchEnv
    from parallel.planner.enumerate import candidate_of
    from parallel.planner.search import _posting_played
    from parallel.pp.rules import posting_refusal
    from parallel.run_plan import ConfigError, build_plan

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", "parallel=pp_1f1b", "parallel.backend=nccl",
                                                       "parallel.pp_posting=gloo"])
    env = LaunchEnv(rank=0, world_size=2, local_world_size=2)
    with pytest.raises(ConfigError) as refused:
        build_plan(cfg, env, cuda_available=True, planning=True)
    plan = build_plan(cfg, env, cuda_available=True, planning=True, replay_schedule=False)
    assert posting_refusal(plan.layout, plan.backend) == str(refused.value)
    candidate, counted = candidate_of("pp", plan, {}), Counter()
    assert not _posting_played({"fits": True, "notes": []}, candidate, counted) and sum(counted.values()) == 1
    over = {"fits": False, "notes": []}
    assert _posting_played(over, candidate, counted) and "not replayed" in over["notes"][0]
    cfg.parallel.pp_posting = "auto"
    auto = build_plan(cfg, env, cuda_available=True, planning=True, replay_schedule=False)
    assert posting_refusal(auto.layout, auto.backend) is None
