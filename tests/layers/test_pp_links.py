"""The pipeline's link groups (parallel/dist/groups.py `link_groups`), on 4 real gloo ranks.

The nccl posting sends each pipeline message on its link: a group of two ranks for one direction of
one neighbour pair. For every pipeline of the layout (dp 2 x pp 2: two pipelines; pp 4 with the
interleaved loop: one, with the wrap-around 3 -> 0), each rank gets exactly the links it is an end
of, each group holds exactly those two global ranks and carries the run's timeout, a message put
on a link arrives at its other end, and the log counts it under the pipeline's group name "pp".
"""

from __future__ import annotations

import datetime

import torch
from spawn import run_ranks, write_result

from parallel.dist.comm import CommLog
from parallel.dist.dims import ParallelDims
from parallel.dist.groups import DistContext, LaunchEnv, group_timeout, link_groups
from parallel.pp.placement import Placement
from parallel.pp.posting import pipeline_links

LAYOUTS = {"dp2xpp2": (dict(dp=2, pp=2), Placement(2, 2)), "pp4-loop-v2": (dict(dp=1, pp=4), Placement(4, 2))}


def exchange(ctx: DistContext, links: dict) -> dict:
    """Every link this rank ends: its receives posted first, then its sends; what arrived, by link."""
    received, handles = {}, []
    for link, comm in sorted(links.items()):
        pipeline = [g for g in ctx.dims.group_ranks("pp") if ctx.rank in g][0]
        if pipeline[link.dst] == ctx.rank:
            received[str(link)] = buf = torch.zeros(1)
            peer = comm.global_ranks.index(pipeline[link.src])
            handles += comm.batch_p2p([("recv", buf, peer, "pp/test")])
    for link, comm in sorted(links.items()):
        pipeline = [g for g in ctx.dims.group_ranks("pp") if ctx.rank in g][0]
        if pipeline[link.src] == ctx.rank:
            peer = comm.global_ranks.index(pipeline[link.dst])
            handles += comm.batch_p2p([("send", torch.tensor([100.0 * ctx.rank + pipeline[link.dst]]), peer,
                                        "pp/test")])
    for handle in handles:
        handle.wait()
    return {name: buf.item() for name, buf in received.items()}


def links_of_every_layout(rank: int, world: int, out_dir) -> None:
    env = LaunchEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    found = {}
    for label, (sizes, placement) in LAYOUTS.items():
        log = CommLog()
        ctx = DistContext(env=env, dims=ParallelDims(world_size=world, **sizes), backend="gloo",
                          device=torch.device("cpu"), log=log)
        links = link_groups(ctx, pipeline_links(placement))
        found[label] = {
            "links": {str(link): {"members": comm.global_ranks, "name": comm.name,
                                  "timeout": group_timeout(comm.group).total_seconds()}
                      for link, comm in links.items()},
            "received": exchange(ctx, links),
            "groups_logged": sorted({group for (_, group, _) in log.outside}),
        }
    write_result(out_dir, rank, found)


def test_each_rank_gets_its_links_with_the_runs_timeout_and_messages_arrive():
    results = run_ranks(4, links_of_every_layout)
    default = datetime.timedelta(seconds=60).total_seconds()  # what spawn.py gives the default group
    for label, (sizes, placement) in LAYOUTS.items():
        dims = ParallelDims(world_size=4, **sizes)
        for pipeline in dims.group_ranks("pp"):
            for pp_rank, rank in enumerate(pipeline):
                found = results[rank][label]
                mine = [link for link in pipeline_links(placement) if pp_rank in (link.src, link.dst)]
                assert sorted(found["links"]) == sorted(map(str, mine)), (label, rank)
                for link in mine:
                    group = found["links"][str(link)]
                    assert group["members"] == sorted([pipeline[link.src], pipeline[link.dst]])
                    assert group["timeout"] == default and group["name"] == "pp"
                arrived = {str(link): 100.0 * pipeline[link.src] + rank for link in mine if link.dst == pp_rank}
                assert found["received"] == arrived, (label, rank)
                assert found["groups_logged"] == ["pp"]
