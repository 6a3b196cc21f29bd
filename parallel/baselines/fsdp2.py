"""PyTorch FSDP2 (`fully_shard`) on the same model: the baseline for `zero3`, and with
`reshard_after_forward=False` for `zero2`.

FSDP2's own docs call `reshard_after_forward=False` ZeRO-2: a group's parameters, gathered for its
forward, stay whole through its backward, and only gradients and optimizer state stay sharded.
`torch_zero2` also keeps them whole between the microbatches of one step
(`set_reshard_after_backward(False)` until the last one, FSDP2's own recipe for gradient
accumulation), so like our `zero2` it gathers every parameter once per step and reduce-scatters
every microbatch's gradients.

Its all-gathers and reduce-scatters go through the communication log as custom collectives
(`set_custom_all_gather`, `set_custom_reduce_scatter`), so every byte it sends is counted by
parallel/dist/comm.py exactly as ours are.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.core.model import part_names, tied_aliases
from parallel.core.optim import AdamW
from parallel.dist.comm import Communicator
from parallel.strategy import GradSync, Strategy, storage_bytes
from parallel.sync.pieces import RankState, model_key, moment_key, row_chunk_piece
from parallel.sync.shards import BETAS, EPS

# A checkpoint's full tensors are gathered this many bytes at a time (TorchFSDP2._gather): few
# collectives, and never the whole model on one device.
GATHER_BUCKET_BYTES = 64 * 2**20


def padded_shard_numel(shape: torch.Size, n: int) -> int:
    """One rank's shard of a tensor of `shape` as FSDP2 cuts it, padded to ceil(d0/n) whole rows."""
    return -(-shape[0] // n) * shape[1:].numel()


def gather_buckets(tensors: dict[str, torch.Tensor], full_shapes: dict[str, torch.Size], n: int,
                   cap: int | None = None) -> list[list[str]]:
    """Consecutive names of one dtype whose gathered tensors (each padded to ceil(d0/n) rows on each
    of the n ranks) fit in `cap` bytes (default GATHER_BUCKET_BYTES) together; a tensor larger than
    that is a bucket of its own."""
    cap = GATHER_BUCKET_BYTES if cap is None else cap
    buckets: list[list[str]] = []
    filled, dtype = 0, None
    for name, local in tensors.items():
        nbytes = n * padded_shard_numel(full_shapes[name], n) * local.element_size()
        if not buckets or local.dtype != dtype or filled + nbytes > cap:
            buckets.append([])
            filled, dtype = 0, local.dtype
        buckets[-1].append(name)
        filled += nbytes
    return buckets


# What the time breakdown of an FSDP2 run on CUDA cannot split (parallel/report/breakdown.py).
FSDP2_CUDA_NOTE = ("FSDP2 runs its all-gathers and reduce-scatters on CUDA streams of its own and makes the compute "
                   "stream wait for them inside its own code, out of the communication log's sight: its collectives "
                   "are counted (bytes) but not timed, so exposed comm is not measured on CUDA and what the compute "
                   "stream waited for is counted in the phase it waited in")


def _side_stream_call(comm: Communicator, tensor: torch.Tensor):
    """Where FSDP2 calls our collectives: on CUDA inside its own side streams, whose time is not what
    the step waited (see FSDP2_CUDA_NOTE), so recorded untimed; on the CPU there are no side
    streams, and the call is timed as any other."""
    return comm.log.untimed() if tensor.is_cuda else contextlib.nullcontext()


class _CountedAllGather:
    """FSDP2's all-gather of one parameter group, through the communication log (synchronous: on
    the CPU FSDP2 has no side streams to overlap with)."""

    def __init__(self, comm: Communicator, tag: str):
        self.comm, self.tag = comm, tag

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        assert group is self.comm.group or dist.get_world_size(group) == self.comm.size
        with _side_stream_call(self.comm, output_tensor):
            self.comm.all_gather_into(output_tensor, input_tensor, tag=self.tag)
        return None


class _CountedReduceScatter:
    """FSDP2's reduce-scatter of one group's gradients, through the communication log. FSDP2 is
    told to sum (divide factor 1, sum-only reductions): our losses are already divided by the
    global token count, as for every strategy."""

    def __init__(self, comm: Communicator, tag: str):
        self.comm, self.tag = comm, tag

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"torch_fsdp2: expected a SUM reduce-scatter, FSDP2 asked for {op}")
        with _side_stream_call(self.comm, input_tensor):
            self.comm.reduce_scatter(output_tensor, input_tensor, tag=self.tag)
        return None


def fsdp2_groups(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units: each Block (a part of model.part_names), then the root, which keeps the
    embedding and the head."""
    blocks = [name for name in part_names(len(model.blocks)) if name.startswith("blocks.")]
    return [*((name, model.get_submodule(name)) for name in blocks), ("root", model)]


class TorchFSDP2(Strategy):
    """`torch.distributed.fsdp.fully_shard` on every Block and on the whole GPT (the root holds
    the embedding and the head), fp32, over the dp mesh. The optimizer is our AdamW on each
    parameter's local shard (the DTensor's local tensor), in the same weight-decay groups."""

    name = "torch_fsdp2"

    def __init__(self, model: nn.Module, dp_mesh, dp_comm: Communicator, lr: float, weight_decay: float,
                 reshard_after_forward: bool = True):
        from torch.distributed.fsdp import fully_shard

        self.comm = dp_comm
        self.reshard_after_forward = reshard_after_forward
        if next(model.parameters()).is_cuda:
            self.exposed_comm_measured, self.breakdown_note = False, FSDP2_CUDA_NOTE
        self.full_shapes = {n: p.shape for n, p in model.named_parameters()}
        self.aliases = tied_aliases(model)  # the gathered state names a shared parameter as the model's state_dict does
        # Left unset (None) for zero3's baseline: FSDP2 then reshards every Block after its forward
        # but keeps the root, used again at once by backward, whole; an explicit True would
        # reshard the root too and gather it twice per microbatch.
        reshard = None if reshard_after_forward else False
        for tag, module in fsdp2_groups(model):
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)
            module.set_custom_all_gather(_CountedAllGather(dp_comm, f"fsdp2/param_all_gather/{tag}"))
            module.set_custom_reduce_scatter(_CountedReduceScatter(dp_comm, f"fsdp2/grad_reduce_scatter/{tag}"))
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.dtensors = dict(model.named_parameters())
        with torch.no_grad():  # views of FSDP2's own shard storage: stepping them updates the model
            self.locals = {n: p.to_local() for n, p in self.dtensors.items()}
        decay = [self.locals[n] for n, p in self.dtensors.items() if p.dim() >= 2]
        no_decay = [self.locals[n] for n, p in self.dtensors.items() if p.dim() < 2]
        optimizer = AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, betas=BETAS, eps=EPS)
        super().__init__(model, optimizer, loss_comm=dp_comm, sync=FSDP2Sync(self.dtensors, self.locals))

    def microbatch_context(self, last_microbatch: bool):
        if not self.reshard_after_forward:
            # ZeRO-2: parameters stay gathered until the step's last backward is done with them.
            self.model.set_reshard_after_backward(last_microbatch)
        return super().microbatch_context(last_microbatch)

    def memory_report(self) -> dict:
        params = storage_bytes(self.locals.values())
        grads = storage_bytes(p.grad.to_local() for p in self.dtensors.values() if p.grad is not None)
        state = storage_bytes(t for s in self.optimizer.state.values() for t in s.values())
        # FSDP2 frees gathered parameters and gradients inside its own code: only the end state
        # is measured here, so the peak is reported as that sum (the allocator's peak is beside it).
        return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state,
                "peak_model_state_bytes": params + grads + state}

    def full_parameter_count(self) -> int:
        return sum(shape.numel() for shape in self.full_shapes.values())

    def _gather(self, tensors: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
        """Full tensors from dim-0 shards as FSDP2 cuts them (torch.chunk: ceil(d0/N) rows per rank,
        the last ranks fewer). Each shard is padded to ceil(d0/N) rows and shards of one dtype are
        laid end to end in one flat buffer, GATHER_BUCKET_BYTES of gathered tensors at a time: a
        checkpoint costs a few all-gathers, not one per parameter (a hundred here, thousands in a
        large model, each paying the latency), and the device never holds more than a bucket of
        full tensors at once (the point of sharding). A gathered bucket holds every rank's run of
        shards in rank order; each full tensor is its rows from every rank's run, trimmed."""
        n, out = self.comm.size, {}
        for names in gather_buckets(tensors, self.full_shapes, n):
            sizes = [padded_shard_numel(self.full_shapes[name], n) for name in names]
            first = tensors[names[0]]
            flat = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
            offset = 0
            for name, size in zip(names, sizes):
                local = tensors[name].reshape(-1)
                flat[offset: offset + local.numel()].copy_(local)
                offset += size
            gathered = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
            self.comm.all_gather_into(gathered, flat, tag=tag)
            runs = gathered.view(n, flat.numel())
            offset = 0
            for name, size in zip(names, sizes):
                shape = self.full_shapes[name]
                full = runs[:, offset: offset + size].reshape(-1, *shape[1:])
                out[name] = full[: shape[0]].detach().cpu().clone()
                offset += size
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = self._gather(self.locals, "tooling/full_state")
        return {**full, **{alias: full[name] for alias, name in self.aliases.items()}}

    def full_grads(self) -> dict:
        return {"grads": self._gather({n: p.grad.to_local() for n, p in self.dtensors.items()}, "tooling/full_grads"),
                "tp_replica_max_diff": {}}

    def full_optimizer_state(self) -> dict:
        state = {}
        for key in ("exp_avg", "exp_avg_sq"):
            values = {n: self.optimizer.state[t][key] if t in self.optimizer.state else torch.zeros_like(t)
                      for n, t in self.locals.items()}
            for n, full in self._gather(values, f"tooling/checkpoint/{key}").items():
                state.setdefault(n, {})[key] = full
        return {"step": self.optimizer.step_count, "state": state}

    def checkpoint_pieces(self):
        """This rank's dim-0 chunk of every parameter and of both moments (no gather)."""
        pieces, (rank, world) = [], (self.comm.rank, self.comm.size)
        for n, local in self.locals.items():
            state = self.optimizer.state.get(local, {})
            pieces += row_chunk_piece(model_key(n), self.full_shapes[n], local.detach(), rank, world)
            for key in ("exp_avg", "exp_avg_sq"):
                pieces += row_chunk_piece(moment_key(n, key), self.full_shapes[n],
                                          state.get(key, torch.zeros_like(local)), rank, world)
        return RankState(pieces, int(self.optimizer.step_count), dict(self.aliases))

    def _my_rows(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 chunk of a full tensor, as FSDP2 cuts it (possibly empty)."""
        rows = -(-self.full_shapes[name][0] // self.comm.size)
        return full[self.comm.rank * rows: (self.comm.rank + 1) * rows]

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        """Each rank copies in its own chunk of the full dicts (no communication)."""
        with torch.no_grad():
            for n, local in self.locals.items():
                local.copy_(self._my_rows(n, model_state[n]))
                if optim_state is not None:
                    state = self.optimizer.state.setdefault(local, {"exp_avg": torch.zeros_like(local),
                                                                    "exp_avg_sq": torch.zeros_like(local)})
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key].copy_(self._my_rows(n, optim_state["state"][n][key]))
            if optim_state is not None:
                self.optimizer.step_count = int(optim_state["step"])

    def close(self) -> None:
        self.comm.wait_all()


class FSDP2Sync(GradSync):
    """FSDP2 reduce-scatters gradients inside its own backward hooks; what is left to this side of
    the protocol is clearing the gradients before a step, and after backward handing each local
    shard the local part of its (sharded DTensor) gradient, which is what our AdamW steps."""

    def __init__(self, dtensors: dict, locals_: dict):
        super().__init__([])
        self.dtensors, self.locals = dtensors, locals_

    def zero_grad(self) -> None:
        for p in self.dtensors.values():
            p.grad = None
        for t in self.locals.values():
            t.grad = None

    def finish(self) -> None:
        for n, p in self.dtensors.items():
            self.locals[n].grad = p.grad.to_local()
        self.complete()


class TorchZero2(TorchFSDP2):
    """FSDP2 as PyTorch's ZeRO-2: the same units, `reshard_after_forward=False` (the baseline for zero2)."""

    name = "torch_zero2"

    def __init__(self, model: nn.Module, dp_mesh, dp_comm: Communicator, lr: float, weight_decay: float):
        super().__init__(model, dp_mesh, dp_comm, lr, weight_decay, reshard_after_forward=False)
