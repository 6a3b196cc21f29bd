"""PyTorch FSDP2 as HSDP (`torch_hsdp`): `fully_shard` on a 2-D DeviceMesh (dp_replicate, dp_shard),
the baseline for `hsdp`.

On a 2-D mesh FSDP2 shards every parameter over the mesh's second dimension and replicates it over
the first: each unit's gradients are reduce-scattered within the shard group and the shard then
all-reduced over the replicate group, the same scheme as parallel/zero/hsdp.py. The mesh is made
from the run's own dp_shard and dp_replicate groups (parallel/dist/dims.py), so FSDP2 runs on
exactly the groups our `hsdp` uses, each with the run's timeout. The all-gathers and
reduce-scatters are counted as torch_fsdp2's are (its custom collectives); the all-reduce goes
through the run's Communicator by counting.RoutedAllReduce. As our `hsdp` does, the all-reduce is
asked for on a step's last microbatch only (`set_requires_all_reduce`); earlier microbatches'
reduce-scattered shards add up inside FSDP2 until then.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.baselines.counting import RoutedAllReduce
from parallel.baselines.fsdp2 import TorchFSDP2, _side_stream_call
from parallel.dist.comm import Communicator
from parallel.sync.pieces import first_replica_only

MESH_DIMS = ("dp_replicate", "dp_shard")  # outermost first: the replicas of one shard are dp_shard ranks apart


def hsdp_mesh(dp_ranks: list[int], shard: Communicator, replicate: Communicator, device_type: str):
    """The (dp_replicate, dp_shard) DeviceMesh over this rank's dp group, on the run's two groups."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.tensor(dp_ranks).view(replicate.size, shard.size)
    return DeviceMesh.from_group([replicate.group, shard.group], device_type, mesh=ranks, mesh_dim_names=MESH_DIMS)


class TorchHSDP(TorchFSDP2):
    """TorchFSDP2's units and optimizer on the 2-D mesh; its loss summed over every dp rank."""

    name = "torch_hsdp"

    def __init__(self, model: nn.Module, mesh, dp: Communicator, shard: Communicator, replicate: Communicator,
                 lr: float, weight_decay: float):
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        super().__init__(model, mesh, shard, lr, weight_decay)
        self.loss_comm = dp
        self.replicate = replicate
        self.routed = lambda: RoutedAllReduce(_fsdp_collectives, [replicate], "fsdp2/grad_all_reduce",
                                              _side_stream_call)

    def microbatch_context(self, last_microbatch: bool):
        self.model.set_requires_all_reduce(last_microbatch)
        super().microbatch_context(last_microbatch)
        return self.routed()

    def checkpoint_pieces(self):
        """The shard group's dim-0 chunks, written by the first replica alone (the others hold the same)."""
        return first_replica_only(super().checkpoint_pieces(), self.replicate.rank)
