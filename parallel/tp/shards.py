"""What `parallelize_tp` did to each parameter, and how to go between a rank's pieces and the wholes.

A parameter is replicated (norms, row-parallel biases, positions), or split along one dim into t
equal pieces, one per tp rank, or, for K and V under grouped-query attention with more tp ranks than
kv heads, split into kv pieces (one per kv head) each held by t/kv consecutive ranks (`replicas`).
Gradients that no rank holds whole after backward are completed over tp (`tp_grad_completions`), where
the dp sync says: the sequence-sharded ones under sequence parallelism, and the kv replicas'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parallel.dist.comm import Communicator
from parallel.strategy import Completion
from parallel.tp.regions import all_gather_along, sum_kv_replica_grads, sum_sequence_partial_grads

GATHER_TAG = "tooling/gather_params"


@dataclass
class TPShards:
    """What `parallelize_tp` did, by parameter name, and how to go between pieces and wholes.

    split_dim: sharded parameters and the dim they are cut along (gather along it to get the full
    tensor). replicas: of those, the ones whose piece t/kv > 1 consecutive ranks share (K and V
    where tp exceeds the kv heads), with that number. sequence_partial: replicated parameters whose
    gradient each rank only partly holds under sequence parallelism (summed over the group after
    backward). With no tp group (`comm` None) nothing is split and every method is the identity,
    so a strategy that may or may not be tensor parallel (a pipeline stage) uses one code path.
    """

    comm: Communicator | None = None
    vocab_start: int = 0
    split_dim: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)
    sequence_partial: list[str] = field(default_factory=list)

    @property
    def rank_and_size(self) -> tuple[int, int]:
        return (self.comm.rank, self.comm.size) if self.comm is not None else (0, 1)

    def gather(self, tensors: dict[str, torch.Tensor], param_of=lambda key: key) -> dict[str, torch.Tensor]:
        """key -> this rank's piece, to key -> the full tensor on the CPU (collective over tp);
        `param_of(key)`: the parameter whose cut the tensor shares (the key itself, or for an Adam
        moment `name/exp_avg` -> `name`). Of a piece that r ranks share, the first one's is kept."""
        out = {}
        for key, t in tensors.items():
            dim = self.split_dim.get(param_of(key))
            if dim is not None and self.comm is not None:
                t = all_gather_along(self.comm, t.detach(), dim, GATHER_TAG)
                r = self.replicas.get(param_of(key), 1)
                if r > 1:  # t pieces, r alike in a row: keep every r-th
                    t = torch.cat(t.chunk(self.comm.size, dim)[::r], dim)
            out[key] = t.detach().cpu().clone()
        return out

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor: equal consecutive pieces along the split dim, one per
        rank, or one per r ranks where r share each."""
        dim = self.split_dim.get(name)
        rank, size = self.rank_and_size
        if dim is None or size == 1:
            return full
        r = self.replicas.get(name, 1)
        n = full.shape[dim] // (size // r)
        return full.narrow(dim, rank // r * n, n)

    def full_numel(self, name: str, piece: torch.Tensor) -> int:
        pieces = self.rank_and_size[1] // self.replicas.get(name, 1) if name in self.split_dim else 1
        return piece.numel() * pieces

    def replica_spread(self, grads: dict[str, torch.Tensor]) -> dict[str, float]:
        """For each replicated parameter and each shared piece, the largest difference of its gradient
        across the tp ranks that hold it (collective): zero, or the copies would drift apart."""
        spread = {}
        if self.comm is None:
            return spread
        for name, g in grads.items():
            r = self.replicas.get(name, 1) if name in self.split_dim else self.comm.size
            if r > 1:
                copies = all_gather_along(self.comm, g.detach().unsqueeze(0), 0, GATHER_TAG)
                copies = copies.view(-1, r, *g.shape)  # (pieces, ranks sharing each, ...)
                spread[name] = float((copies - copies[:, :1]).abs().max())
        return spread


def tp_grad_completions(shards: TPShards, params: dict[str, nn.Parameter]) -> list[Completion]:
    """The sums over tp that complete this rank's gradients, for a dp sync's `completions`: the
    sequence-sharded replicated parameters' (`tp/sp_grads`) and the kv replicas' (`tp/kv_grads`), of
    those in `params` (a pipeline stage holds only some)."""
    comm, out = shards.comm, []
    sequence_partial = [params[n] for n in shards.sequence_partial if n in params]
    if sequence_partial:
        out.append(Completion(sequence_partial, lambda grads: sum_sequence_partial_grads(grads, comm)))
    kv = [n for n in shards.replicas if n in params]
    if kv:
        replicas = {shards.replicas[n] for n in kv}
        assert len(replicas) == 1, "every kv replica is shared by the same number of ranks"
        r = replicas.pop()
        out.append(Completion([params[n] for n in kv], lambda grads: sum_kv_replica_grads(grads, r, comm)))
    return out
