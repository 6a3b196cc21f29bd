"""The loopback probe goes through the run's Communicator, and under NCCL nothing of train.py's
tooling hands a CPU tensor to a collective.

On 3 real gloo ranks (the probing pair is ranks 0 and 1; rank 2 waits for the figures):

- on gloo, `probe_loopback` measures through the world's log: every call it made is in the log,
  outside the steps, under `tooling/probe/...` (none under a strategy's tag), the payload
  all-reduces between the fewest and the most of PAYLOAD_REPEATS, the same number on both members,
  and its pair group carries the run's timeout (the default group's, 60 s in spawn.py);
- with the default group's backend faked as NCCL (`dist.get_backend` answers "nccl" for every
  group not made with backend="gloo", as torch would for a job started with backend="nccl"), and
  every torch.distributed collective and p2p op guarded so that a CPU tensor given to an "nccl"
  group fails as NCCL fails ("No backend type associated with device type cpu"), the tooling
  path of train.py runs to the end: the run directory's broadcast, the peer table, `_link_model`
  (which must make no call at all and return no link model: the virtual clock models CPU ranks),
  the gathering of the reports and the shutdown barrier. Object collectives pass: torch moves an
  object's bytes to the group's device (`_get_object_coll_device`), as it does under real NCCL.
  The step's own tensors (the loss for the log, the finite check) are made on the run's device
  from the model's, so a CPU process cannot show them apart; this test covers what train.py makes
  on its own. Before the fix the probe broadcast its figures as a CPU tensor on the default
  group, and this test failed there.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
from spawn import run_ranks, write_result

from parallel.dist.comm import CommLog
from parallel.dist.dims import ParallelDims
from parallel.dist.groups import DistContext, LaunchEnv, add_layout_groups, group_timeout
from parallel.reliability.faults import peer_table
from parallel.replay.probe import PAYLOAD_BYTES, PAYLOAD_REPEATS, probe_loopback
from parallel.report.virtual import NOT_REPLAYED, replayable, virtual_block
from parallel.train import Run, _link_model, _resolve_run_dir

GUARDED = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "broadcast", "send",
           "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "all_gather", "all_gather_into_tensor",
           "reduce_scatter_tensor", "gather", "scatter", "reduce", "broadcast_object_list", "gather_object",
           "all_gather_object", "scatter_object_list", "monitored_barrier")


def tensors_and_groups(args, kwargs) -> tuple[list[torch.Tensor], list]:
    """The tensors a call is given (in lists, and in P2POps) and the groups it names (None: default)."""
    tensors, groups = [], [kwargs.get("group")]
    for a in [*args, *kwargs.values()]:
        for item in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(item, torch.Tensor):
                tensors.append(item)
            elif isinstance(item, dist.P2POp):
                tensors.append(item.tensor)
                groups.append(item.group)
    return tensors, groups


@contextlib.contextmanager
def faked_nccl(calls: list[str], violations: list[str]):
    """Every group answers "nccl" but those made inside with backend="gloo"; every guarded op records
    itself in `calls` and refuses a CPU tensor on an "nccl" group as NCCL does."""
    gloo_groups, saved = [], {name: getattr(dist, name) for name in (*GUARDED, "get_backend", "new_group")}

    def backend(group=None):
        return "gloo" if group is not None and any(group is g for g in gloo_groups) else "nccl"

    def new_group(*args, **kwargs):
        group = saved["new_group"](*args, **kwargs)
        if kwargs.get("backend") == "gloo":
            gloo_groups.append(group)
        return group

    def guarded(name, fn):
        def call(*args, **kwargs):
            tensors, groups = tensors_and_groups(args, kwargs)
            calls.append(name)
            if any(backend(g) == "nccl" for g in groups) and any(t.device.type == "cpu" for t in tensors):
                violations.append(f"{name} given a CPU tensor on an NCCL group")
                raise RuntimeError("No backend type associated with device type cpu")
            return fn(*args, **kwargs)
        return call

    try:
        for name in GUARDED:
            setattr(dist, name, guarded(name, saved[name]))
        dist.get_backend, dist.new_group = backend, new_group
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def recording_timeouts(found: list[float]):
    """dist.new_group as it is, each new group's timeout (seconds) appended to `found`."""
    real = dist.new_group

    def new_group(*args, **kwargs):
        group = real(*args, **kwargs)
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            found.append(group_timeout(group).total_seconds())
        return group

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = real


def probe_on_gloo(ctx: DistContext) -> dict:
    timeouts = []
    with recording_timeouts(timeouts):
        link = probe_loopback(ctx.comm("world"), lambda rank: 0, {}, "batch")
    logged = {f"{group}|{op}|{tag}": (t.calls, t.payload_bytes, float(t.sent_bytes))
              for (op, group, tag), t in ctx.log.outside.items()}
    return {"source": link.source, "pair_timeouts": timeouts, "logged": logged,
            "in_steps": len(ctx.log.steps)}


def tooling_under_nccl(ctx: DistContext, out_dir) -> dict:
    calls, violations = [], []
    plan = SimpleNamespace(dims=ctx.dims, gloo_loop_policy="batch", run_dir=str(out_dir / "run"), strategy="dp")
    world = ctx.comm("world")
    with faked_nccl(calls, violations):
        seen_backend = world.backend
        run = Run(plan=plan, ctx=ctx, run_dir=_resolve_run_dir(plan, ctx), strategy=None)
        ctx.peers = peer_table(world)
        before = len(calls)
        links = _link_model(run, {"virtual": {}})
        link_model_calls = calls[before:]
        reports = world.gather_object({"rank": ctx.rank}, 0, tag="tooling/summary")
        world.barrier(tag="tooling/shutdown")
    return {"backend": seen_backend, "links": None if links is None else links.source, "calls": calls,
            "link_model_calls": link_model_calls, "violations": violations, "reports": reports,
            "run_dir": str(run.run_dir)}


def probe_paths(rank: int, world: int, out_dir) -> None:
    env = LaunchEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    ctx = DistContext(env=env, dims=ParallelDims(world_size=world, dp=world), backend="gloo",
                      device=torch.device("cpu"), log=CommLog())
    add_layout_groups(ctx)
    write_result(out_dir, rank, {"gloo": probe_on_gloo(ctx), "nccl": tooling_under_nccl(ctx, out_dir)})


def test_the_probe_is_logged_on_gloo_and_absent_under_nccl():
    results = run_ranks(3, probe_paths)
    payloads = []
    for rank, r in enumerate(results):
        gloo = r["gloo"]
        assert gloo["source"].startswith("probed in this run: ranks 0 and 1"), gloo["source"]
        assert gloo["in_steps"] == 0
        assert gloo["logged"], f"rank {rank}: the probe's calls are not in the log"
        assert all(key.split("|")[2].startswith("tooling/probe/") for key in gloo["logged"]), gloo["logged"]
        if rank < 2:
            assert gloo["pair_timeouts"] == [60.0], f"rank {rank}: the pair group's timeout {gloo['pair_timeouts']}"
            calls, payload, sent = gloo["logged"]["probe|all_reduce|tooling/probe/payload"]
            assert PAYLOAD_REPEATS[0] <= calls <= PAYLOAD_REPEATS[1] and payload == sent == calls * PAYLOAD_BYTES
            payloads.append(calls)
        else:  # not a member: it only learns the figures
            assert set(gloo["logged"]) == {"world|broadcast_object|tooling/probe/figures"}, gloo["logged"]
    assert payloads[0] == payloads[1], f"the two members made {payloads} payload all-reduces"
    for rank, r in enumerate(results):
        nccl = r["nccl"]
        assert nccl["backend"] == "nccl"  # the fake reached the world's Communicator
        assert nccl["violations"] == [], f"rank {rank}: {nccl['violations']}"
        assert nccl["links"] is None and nccl["link_model_calls"] == [], (rank, nccl)
        assert {"broadcast_object_list", "gather_object", "barrier"} <= set(nccl["calls"])  # the guard saw them
        assert nccl["run_dir"] == results[0]["nccl"]["run_dir"]
    assert results[0]["nccl"]["reports"] == [{"rank": r} for r in range(3)]


def test_a_gpu_runs_summary_says_why_it_has_no_virtual_block(tmp_path):
    assert replayable("cpu", "gloo") and replayable("cpu", None)
    assert not replayable("cuda", "nccl") and not replayable("cuda", None) and not replayable("cpu", "nccl")
    plan = SimpleNamespace(backend="nccl", timeline=False)
    block = virtual_block(plan, [{"events": {"steps": []}}], {"device": "cuda"}, tmp_path, links=None)
    assert block == {"skipped": NOT_REPLAYED}
    assert not (tmp_path / "events").exists()
