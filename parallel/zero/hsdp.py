"""HSDP (`hsdp`, `hsdp_zero2`): ZeRO inside a shard group, plain data parallelism across the groups.

The dp ranks split into dp / dp_shard shard groups of dp_shard consecutive ranks (parallel/dist/dims.py:
with ranks placed node by node, one group per node where dp_shard is the processes per node). Each
shard group runs ZeRO-3 (`hsdp`, parallel/zero/zero3.py) or ZeRO-2 (`hsdp_zero2`,
parallel/sync/zero.py) exactly as over a dp group of its own: the same flat padded parts, the same
reduce-scatters and all-gathers, now over the dp_shard communicator. The groups hold the same
shards of the same model, and each has summed only its own ranks' gradients; so, once a step's
reduce-scatters are in, every rank all-reduces its gradient shard over the ranks of the other groups
that hold the same shard (the dp_replicate group). A sum of the groups' sums is the sum over every dp
rank, which is what ZeRO over all of dp would have had: the losses are already divided by the
global token count, so no scaling follows. Each rank then steps its shard as before.

That one all-reduce of a 1/dp_shard shard is all the replicate group sends (FSDP2's HSDP, ZeRO++'s
hpZ and torchtitan's dp_replicate do the same): on two nodes it is all that crosses the slow link,
where ZeRO-3 over both nodes sends its parameter gathers and gradient scatters across it.
"""

from __future__ import annotations

import torch.nn as nn

from parallel.dist.comm import Communicator
from parallel.strategy import GradSync
from parallel.sync.pieces import first_replica_only
from parallel.zero.strategy import ZeroDataParallel
from parallel.zero.zero3 import Zero3


class ReplicatedShards(GradSync):
    """A ZeRO sync (`inner`) whose gradient shards are then summed over the replicate group.

    `shards` are the tensors `inner` leaves the shard group's sums in (one per part, as `parts`);
    after `inner.finish()` each is all-reduced in place, all posted at once and then waited for."""

    def __init__(self, inner: GradSync, parts: list, shards: list, replicate: Communicator):
        super().__init__([])
        self.inner, self.parts, self.shards, self.replicate = inner, parts, shards, replicate

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def before_microbatch(self, last: bool) -> None:
        self.inner.before_microbatch(last)

    def finish(self) -> None:
        self.inner.finish()
        handles = [self.replicate.all_reduce(shard, tag=f"hsdp/grad_all_reduce/{part.name}", async_op=True)
                   for part, shard in zip(self.parts, self.shards)]
        for handle in handles:
            handle.wait()

    def synced_grads(self):
        return self.inner.synced_grads()

    def memory(self):
        return self.inner.memory()


class Hybrid:
    """What `hsdp` and `hsdp_zero2` add to the ZeRO strategy they extend (Zero3 or ZeroDataParallel over
    the shard group): the replicate all-reduce after its sync, the loss over all of dp, and a sharded
    checkpoint written by the first replica of each shard alone (the others hold the same pieces)."""

    def replicate_over(self, dp: Communicator, replicate: Communicator, parts: list, shards: list) -> None:
        self.replicate = replicate
        self.sync = ReplicatedShards(self.sync, parts, shards, replicate)
        self.loss_comm = dp  # every dp rank has its own slice of the batch, whichever group it shards in

    def checkpoint_pieces(self):
        return first_replica_only(super().checkpoint_pieces(), self.replicate.rank)


class HSDP(Hybrid, Zero3):
    """ZeRO-3 inside each shard group (`hsdp`)."""

    name = "hsdp"

    def __init__(self, model: nn.Module, dp: Communicator, shard: Communicator, replicate: Communicator,
                 lr: float, weight_decay: float):
        super().__init__(model, shard, lr, weight_decay)
        self.replicate_over(dp, replicate, self.parts, self.grad_shards)


class HSDPZero2(Hybrid, ZeroDataParallel):
    """ZeRO-2 inside each shard group (`hsdp_zero2`)."""

    def __init__(self, model: nn.Module, dp: Communicator, shard: Communicator, replicate: Communicator,
                 lr: float, weight_decay: float):
        super().__init__(model, shard, 2, lr, weight_decay)
        self.name = "hsdp_zero2"
        self.replicate_over(dp, replicate, self.zero.parts, self.zero.grad_shards)
