"""ZeRO stage 3 (`zero3`): parameters, gradients and optimizer state all sharded over dp.

Each rank keeps, per model part (embedding, each Block, head; see parallel/sync/shards.py), only its shard of the
flat padded parameters, of the summed gradients and of the Adam moments: 16·Ψ_pad/N bytes. A
part's full parameters exist only while the part computes:

    forward pre-hook      all-gather the part's parameters   (zero/param_all_gather/fwd/<part>)
    forward hook          free them; hook the part's output, so that
    output's grad hook    all-gathers them again just before the part's backward
                          (zero/param_all_gather/bwd/<part>)
    post-accumulate-grad  copy each new gradient into the part's flat gradient buffer and drop it;
    hooks                 when the part's last one arrives, free the gathered parameters and start
                          the buffer's reduce-scatter (zero/grad_reduce_scatter/<part>), which runs
                          while backward goes on with the part before; it is waited for (added
                          into the gradient shard, the buffer freed) when the next part's starts

How parameters are freed without disturbing autograd (FSDP1's trick): every parameter of a part
is a view into the part's one flat buffer, and freeing resizes that buffer's *storage* to 0 bytes.
The tensors autograd saved in forward still point at the same storage; the backward all-gather
resizes it back and fills it before any of them is read. Once a part's last parameter has its
gradient, every backward node that read the part's parameters has run (each such node sends a
gradient to them), so freeing then is safe.

Both collectives go through `self.wire`, the dp Communicator itself for parallel.comm_dtype=fp32,
else its low-precision collectives (parallel/sync/lowprec.py): the shards stay fp32, only what
crosses between ranks is rounded.

With several microbatches, each one gathers twice and reduce-scatters once per part; the
gradient shards add up. The optimizer (zero.ShardAdamW) steps the shards directly; no all-gather
follows the step, the next forward gathers what it needs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from parallel.core.model import part_names
from parallel.dist.comm import Communicator
from parallel.strategy import GradSync, Strategy, storage_bytes
from parallel.sync.lowprec import collectives
from parallel.sync.pieces import zero_pieces
from parallel.sync.shards import (
    GradReduceScatter,
    MemoryMeter,
    Part,
    ShardAdamW,
    gather_full,
    gather_optimizer_state,
    group_into_parts,
)

log = logging.getLogger(__name__)


class Zero3(Strategy):
    name = "zero3"

    def __init__(self, model: nn.Module, dp_comm: Communicator, lr: float, weight_decay: float,
                 comm_dtype: str = "fp32"):
        self.comm = dp_comm
        self.meter = MemoryMeter()
        self.wire = collectives(dp_comm, comm_dtype, meter=self.meter)  # gathers and reduce-scatters in comm_dtype
        self.parts: list[Part] = group_into_parts(list(model.named_parameters()), dp_comm.size, dp_comm.rank)
        assert [p.name for p in self.parts] == part_names(len(model.blocks)), [p.name for p in self.parts]
        # parameter -> (index of its part, its index in the part)
        self._where = {p: (k, i) for k, part in enumerate(self.parts) for i, p in enumerate(part.params)}
        self.full: list[torch.Tensor] = []  # per part: the flat full buffer (storage 0 bytes when freed)
        self.shards: list[torch.Tensor] = []
        self.grad_shards: list[torch.Tensor] = []
        for index, part in enumerate(self.parts):
            flat = part.flatten([p.detach() for p in part.params])
            self.shards.append(flat[part.lo: part.hi].clone())
            self.grad_shards.append(torch.zeros(part.shard_numel, dtype=part.dtype, device=part.device))
            for p, view in zip(part.params, part.unflatten(flat).values()):
                p.data = view
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            flat.untyped_storage().resize_(0)
            self.full.append(flat)
            module = model.get_submodule(part.name)
            module.register_forward_pre_hook(self._gather_for_forward(index))
            module.register_forward_hook(self._free_after_forward(index))
        self.reduction = GradReduceScatter(self.parts, self.grad_shards, self.wire, self.meter)
        optimizer = ShardAdamW(self.parts, self.shards, self.grad_shards, lr, weight_decay)
        super().__init__(model, optimizer, loss_comm=dp_comm, sync=Zero3Sync(self))
        log.info("zero3: %d parts, padded sizes %s, shard %d elements", len(self.parts),
                 [p.padded for p in self.parts], sum(p.shard_numel for p in self.parts))

    # -- gather and free ---------------------------------------------------------------------------
    def _gather(self, index: int, direction: str) -> None:
        part, flat = self.parts[index], self.full[index]
        if flat.untyped_storage().nbytes():
            raise RuntimeError(f"zero3: {part.name}'s parameters gathered twice without a free")
        flat.untyped_storage().resize_(part.nbytes)
        self.meter.add(part.nbytes)
        self.wire.all_gather_into(flat, self.shards[index], tag=f"zero/param_all_gather/{direction}/{part.name}")

    def _free(self, index: int) -> None:
        self.full[index].untyped_storage().resize_(0)
        self.meter.sub(self.parts[index].nbytes)

    def _gather_for_forward(self, index: int):
        def hook(_module, _inputs):
            self._gather(index, "fwd")
        return hook

    def _free_after_forward(self, index: int):
        def hook(_module, _inputs, output):
            self._free(index)
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda _grad: self._gather_for_backward(index))
            return output
        return hook

    def _gather_for_backward(self, index: int) -> None:
        self.parts[index].waiting = len(self.parts[index].params)
        self._gather(index, "bwd")

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index, i = self._where[param]
        self.reduction.take(index, i, param)
        if self.parts[index].waiting == 0:
            # The part's backward is over: free its parameters now, and reduce-scatter its
            # gradients asynchronously while backward goes on with the part before it.
            self._free(index)
            self.reduction.launch(index)

    # -- the step: the gradient-sync protocol (Zero3Sync) calls these --------------------------------
    def reset_gradients(self) -> None:
        for g in self.grad_shards:
            g.zero_()
        self.meter.current = self.persistent_bytes()
        self.meter.reset_peak()

    def check_all_freed(self) -> None:
        self.reduction.wait()
        gathered = [p.name for p, f in zip(self.parts, self.full) if f.untyped_storage().nbytes()]
        if gathered or self.reduction.buffers:
            raise RuntimeError(f"zero3: parts {gathered or list(self.reduction.buffers)} still gathered after backward "
                               "(some parameter got no gradient: every parameter must take part in the loss)")

    # -- what this rank holds ----------------------------------------------------------------------
    def persistent_bytes(self) -> int:
        return (storage_bytes(self.shards) + storage_bytes(self.grad_shards)
                + storage_bytes(self.optimizer.state_tensors()))

    def memory_report(self) -> dict:
        return {
            # The model's own parameters count too: after a step their storage is freed (0 bytes).
            "param_bytes": storage_bytes([*self.shards, *self.model.parameters()]),
            "grad_bytes": storage_bytes(self.grad_shards),
            "optimizer_bytes": storage_bytes(self.optimizer.state_tensors()),
            "peak_model_state_bytes": self.meter.peak,
        }

    # -- whole-model views (collective) ------------------------------------------------------------
    def full_parameter_count(self) -> int:
        return sum(part.numel for part in self.parts)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_full(self.parts, self.shards, self.comm, "tooling/full_state")

    def full_grads(self) -> dict:
        return {"grads": gather_full(self.parts, self.grad_shards, self.comm, "tooling/full_grads"),
                "tp_replica_max_diff": {}}

    def full_optimizer_state(self) -> dict:
        return gather_optimizer_state(self.parts, self.optimizer, self.comm)

    def checkpoint_pieces(self):
        return zero_pieces(self.parts, self.shards, self.optimizer)

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        with torch.no_grad():
            for i, part in enumerate(self.parts):
                self.shards[i].copy_(part.flatten([model_state[n] for n in part.names])[part.lo: part.hi])
                if optim_state is not None:
                    for key in ("exp_avg", "exp_avg_sq"):
                        full = part.flatten([optim_state["state"][n][key] for n in part.names])
                        self.optimizer.load_shard_state(i, key, full[part.lo: part.hi])
            if optim_state is not None:
                self.optimizer.adamw.step_count = int(optim_state["step"])

    def close(self) -> None:
        self.comm.wait_all()


class Zero3Sync(GradSync):
    """ZeRO-3's side of the gradient-sync protocol: its reductions run in hooks during backward,
    so a step only zeroes the shards, waits for the previous microbatch's reduce-scatter, and at
    the end checks that every gathered part was freed."""

    def __init__(self, zero3: Zero3):
        super().__init__([])
        self.zero3 = zero3

    def zero_grad(self) -> None:
        self.zero3.reset_gradients()

    def before_microbatch(self, last: bool) -> None:
        self.zero3.reduction.wait()  # the previous microbatch's

    def finish(self) -> None:
        if self.completions:
            raise RuntimeError("zero3 reduces gradients inside backward, "
                               "before completions over another group could run")
        self.zero3.check_all_freed()
