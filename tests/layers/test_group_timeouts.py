"""Every process group a run makes carries the run's timeout, parallel.timeout_s.

torch gives a group made without one its backend's default (30 minutes on gloo, 10 on NCCL),
whatever the default group was given; a rank that hangs inside a tp or dp group would then be
reported after minutes. On 4 real gloo ranks whose default group has a 60 s timeout, the groups of
every dimension (the mesh's and the derived ones: ep, edp, dp_cp) must have 60 s too.
"""

from __future__ import annotations

import datetime

import torch
from spawn import run_ranks, write_result

from parallel.dist.comm import CommLog
from parallel.dist.dims import ParallelDims
from parallel.dist.groups import DistContext, LaunchEnv, add_layout_groups, group_timeout

LAYOUTS = {  # every dimension and derived group of DIMS appears in one of them
    "dp2xtp2": dict(dp=2, tp=2),
    "pp2xcp2": dict(dp=1, pp=2, cp=2),
    "dp2xcp2": dict(dp=2, cp=2),
    "dp4xep2": dict(dp=4, ep=2),
}


def timeouts(rank: int, world: int, out_dir) -> None:
    env = LaunchEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    found = {}
    for label, sizes in LAYOUTS.items():
        ctx = DistContext(env=env, dims=ParallelDims(world_size=world, **sizes), backend="gloo",
                          device=torch.device("cpu"), log=CommLog())
        add_layout_groups(ctx)
        found[label] = {name: group_timeout(comm.group).total_seconds() for name, comm in ctx.comms.items()}
    write_result(out_dir, rank, found)


def test_every_group_has_the_runs_timeout():
    results = run_ranks(4, timeouts)
    default = datetime.timedelta(seconds=60).total_seconds()  # what spawn.py gives the default group
    names = set()
    for rank, found in enumerate(results):
        for label, groups in found.items():
            names |= set(groups)
            late = {name: seconds for name, seconds in groups.items() if seconds != default}
            assert not late, f"rank {rank}, {label}: groups made with another timeout than the run's: {late}"
    assert names == {"world", "pp", "dp", "cp", "tp", "ep", "edp", "dp_cp"}
