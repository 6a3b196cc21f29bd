"""ZeRO (Rajbhandari et al. 2019), stages 1, 2 and 3, written by hand on the communication log.

Plain data parallelism keeps on every rank the whole model, all its gradients and all the
optimizer state (fp32 Adam: 4 + 4 + 8 bytes per parameter). ZeRO keeps the same computation but
lets each of the N data-parallel ranks *own* 1/N of every tensor of model state:

* stage 1 (`zero1`): each rank keeps the optimizer state of its shard only. After backward (once
  per optimizer step, after accumulating all microbatches locally) the gradients are
  reduce-scattered, so each rank holds the summed gradient of its shard; it steps its shard; the
  updated shards are all-gathered so every rank has the whole model again.
* stage 2 (`zero2`): gradients are sharded as well. As backward finishes the gradients of one
  model part, the part is reduce-scattered at once (asynchronously, while backward goes on with
  earlier parts; one in flight at a time) and the part's full gradients are freed; each rank
  keeps only its shard of the summed gradient. With several microbatches every microbatch's
  backward reduce-scatters and the results add up in the shard, as DeepSpeed's stage 2 does: no
  full gradient outlives its part's backward, at the price of one reduce-scatter per microbatch.
* stage 3 (`zero3`): parameters are sharded too. A part's parameters exist in full only while it
  computes: all-gathered just before its forward, freed after it; all-gathered again just before
  its backward, freed (with its full gradients) once its gradients are reduce-scattered.

The unit of sharding is a *part* of the model, the pieces model.py is made of: the embedding, each
Block, the head (`_part_of` in dp.py names a parameter's part). Each part's parameters live in one
flat fp32 buffer, padded with zeros to a multiple of N so it splits into N equal shards; rank r
owns elements [r·S, (r+1)·S) of every part, S = padded / N. Padding is why the bytes moved and held
are computed on Ψ_pad = Σ_parts ceil(Ψ_part / N)·N (theory.zero_padded_parameter_count).

The optimizer sees only its shard: parallel/optim.py's AdamW over the pieces of the shard, one
piece per parameter the shard overlaps (and one for the padding), each piece in the weight-decay
group of its parameter (no decay on biases and LayerNorm weights, as strategy.make_optimizer).
AdamW is elementwise, so stepping the pieces does per element the same arithmetic as stepping the
whole parameters.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn as nn

from .comm import Communicator
from .dp import _part_of
from .optim import AdamW
from .strategy import Strategy, storage_bytes

log = logging.getLogger(__name__)

BETAS, EPS = (0.9, 0.95), 1e-8  # as strategy.make_optimizer


def padded_size(numel: int, world: int) -> int:
    """The smallest multiple of `world` that holds `numel` elements."""
    return -(-numel // world) * world


class MemoryMeter:
    """Model-state bytes held now and at most, counted from the tensors allocated and freed.

    At the start of each step `current` is set to the persistent tensors (parameters, gradients
    and optimizer state a rank keeps between steps), measured; transients (gathered parameters, full gradients of a part before its
    reduce-scatter, communication buffers) are added when allocated and taken off when freed.
    """

    def __init__(self):
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current


class Part:
    """One model part's parameters as one flat buffer, padded to a multiple of the dp size."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], world: int, rank: int):
        self.name = name
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.padded = padded_size(self.numel, world)
        self.shard_numel = self.padded // world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.nbytes = self.padded * p0.element_size()  # the full flat buffer
        self.shard_nbytes = self.shard_numel * p0.element_size()
        self.waiting = len(self.params)  # gradients still to come in this backward

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The flat padded buffer of `tensors` (one per parameter, in order)."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for t, off in zip(tensors, self.offsets):
            flat[off: off + t.numel()].copy_(t.reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full flat buffer -> {parameter name: tensor} (views into `flat`)."""
        return {n: flat[off: off + p.numel()].view_as(p) for n, p, off in zip(self.names, self.params, self.offsets)}

    def pieces(self) -> list[tuple[int, int, bool]]:
        """This rank's shard cut where parameters begin and end: (start, end, decay) in shard
        coordinates, covering [0, S) exactly; the padding is one no-decay piece."""
        out = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                out.append((a - self.lo, b - self.lo, p.dim() >= 2))
        pad_start = max(self.numel, self.lo)
        if pad_start < self.hi:
            out.append((pad_start - self.lo, self.shard_numel, False))
        return out


def group_into_parts(named_params: list[tuple[str, nn.Parameter]], world: int, rank: int) -> list[Part]:
    """Parameters grouped by model part, parts in the order their parameters come."""
    by_part: dict[str, list] = {}
    for name, p in named_params:
        if p.requires_grad:
            by_part.setdefault(_part_of(name), []).append((name, p))
    return [Part(name, params, world, rank) for name, params in by_part.items()]


class ShardAdamW:
    """AdamW over the shards of several parts: each part's shard cut into pieces (Part.pieces),
    every piece a view into the shard, stepped by parallel/optim.py's AdamW in the weight-decay
    group of its parameter."""

    def __init__(self, parts: list[Part], shards: list[torch.Tensor], grad_shards: list[torch.Tensor],
                 lr: float, weight_decay: float):
        decay, no_decay = [], []
        self.pieces: list[list[torch.Tensor]] = []  # per part, its pieces in shard order
        for part, shard, grad in zip(parts, shards, grad_shards):
            views = []
            for a, b, decays in part.pieces():
                view = shard[a:b]
                view.grad = grad[a:b]
                (decay if decays else no_decay).append(view)
                views.append(view)
            self.pieces.append(views)
        self.adamw = AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=lr, betas=BETAS, eps=EPS)

    def step(self) -> None:
        self.adamw.step()

    @property
    def step_count(self) -> int:
        return self.adamw.step_count

    def state_bytes(self) -> int:
        return self.adamw.state_bytes()

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.adamw.state.values() for t in s.values()]

    def shard_state(self, part_index: int, key: str) -> torch.Tensor:
        """One part's `exp_avg` or `exp_avg_sq` over its whole shard (zeros before the first step)."""
        return torch.cat([self.adamw.state[v][key] if v in self.adamw.state else torch.zeros_like(v)
                          for v in self.pieces[part_index]])

    def load_shard_state(self, part_index: int, key: str, shard_values: torch.Tensor) -> None:
        offset = 0
        for v in self.pieces[part_index]:
            state = self.adamw.state.setdefault(v, {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v)})
            state[key].copy_(shard_values[offset: offset + v.numel()])
            offset += v.numel()


def _gather_full(parts: list[Part], shards: list[torch.Tensor], comm: Communicator, tag: str) -> dict[str, torch.Tensor]:
    """Every part's full tensors from its shards (collective; tooling traffic), on the CPU."""
    out = {}
    for part, shard in zip(parts, shards):
        full = torch.empty(part.padded, dtype=shard.dtype, device=shard.device)
        comm.all_gather_into(full, shard.contiguous(), tag=f"{tag}/{part.name}")
        out.update({n: t.detach().cpu().clone() for n, t in part.unflatten(full).items()})
    return out


class GradReduceScatter:
    """Stages 2 and 3: each new gradient is copied into its part's full flat buffer and dropped at
    once (`take`); `launch(k)` reduce-scatters a complete part asynchronously, and `wait()` adds
    the results into this rank's gradient shards and frees the full buffers. One reduce-scatter
    in flight at a time: waiting for the previous part's first keeps at most two parts' full
    gradients alive (the point of stage 2), while each one still overlaps with the backward of the
    part before it."""

    def __init__(self, parts: list[Part], grad_shards: list[torch.Tensor], comm: Communicator, meter: MemoryMeter):
        self.parts, self.grad_shards, self.comm, self.meter = parts, grad_shards, comm, meter
        self.buffers: dict[int, torch.Tensor] = {}  # part index -> full gradient buffer being filled
        self._in_flight: list[tuple] = []  # (part index, handle, output)

    def take(self, index: int, i: int, param: nn.Parameter) -> None:
        """Move `param.grad` (the i-th parameter of part `index`) into the part's buffer."""
        part = self.parts[index]
        buffer = self.buffers.get(index)
        if buffer is None:
            buffer = self.buffers[index] = torch.zeros(part.padded, dtype=part.dtype, device=part.device)
            self.meter.add(part.nbytes)
        grad_bytes = param.grad.numel() * param.grad.element_size()
        self.meter.add(grad_bytes)
        buffer[part.offsets[i]: part.offsets[i] + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None
        self.meter.sub(grad_bytes)
        part.waiting -= 1

    def launch(self, index: int) -> None:
        self.wait()
        out = torch.empty_like(self.grad_shards[index])
        self.meter.add(self.parts[index].shard_nbytes)
        handle = self.comm.reduce_scatter(out, self.buffers[index], tag=f"zero/grad_reduce_scatter/{self.parts[index].name}",
                                          async_op=True)
        self._in_flight.append((index, handle, out))

    def wait(self) -> None:
        for index, handle, out in self._in_flight:
            handle.wait()
            self.grad_shards[index].add_(out)
            del self.buffers[index]
            self.meter.sub(self.parts[index].nbytes + self.parts[index].shard_nbytes)
        self._in_flight = []


def gather_optimizer_state(parts: list[Part], optimizer: ShardAdamW, comm: Communicator) -> dict:
    """{"step", "state": {name: {"exp_avg", "exp_avg_sq"}}} of the whole model from every rank's
    shards (collective; every rank gets it, rank 0 is the one that saves)."""
    state: dict[str, dict] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        shards = [optimizer.shard_state(i, key) for i in range(len(parts))]
        for name, t in _gather_full(parts, shards, comm, f"tooling/checkpoint/{key}").items():
            state.setdefault(name, {})[key] = t
    return {"step": optimizer.step_count, "state": state}


class ZeroOptimizer:
    """ZeRO stage 1 or 2 over one data-parallel group: the gradient sync and the optimizer in one.

    Built from the local parameters under their full-model names (a whole model, a tensor-parallel
    shard or a pipeline stage alike) and the dp Communicator. Same interface as dp.py's gradient
    syncs, plus the optimizer's:

        zero_grad()                  before a step's first microbatch
        arm(last_microbatch)         before each microbatch's forward and backward
        finish()                     after the last microbatch's backward: gradient shards ready
        step()                       step the own shard, all-gather the updated parameters
        state_bytes(), memory()      what this rank holds
        full_optimizer_state()       the whole model's Adam moments (collective)
        load_full_state(m, o)        copy in this rank's part of full dicts (no communication)

    Stage 2 reduces in backward hooks, before finish(): a gradient that must first be completed
    over another group (sequence parallelism's partial norm gradients over tp) has to be
    completed before its part's hook fires, or use stage 1, which reduces only in finish().

    After construction the parameters are views into per-part flat buffers (their values are
    unchanged); the model is used as before.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], dp_comm: Communicator, stage: int,
                 lr: float, weight_decay: float):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles ZeRO stages 1 and 2, not {stage} (zero3 is Zero3)")
        self.stage = stage
        self.comm = dp_comm
        self.meter = MemoryMeter()
        self.parts = group_into_parts(named_params, dp_comm.size, dp_comm.rank)
        # parameter -> (index of its part, its index in the part)
        self._where = {p: (k, i) for k, part in enumerate(self.parts) for i, p in enumerate(part.params)}
        self.flat_params, self.flat_grads, grad_shards = [], [], []
        for part in self.parts:
            flat = part.flatten([p.detach() for p in part.params])
            for p, view in zip(part.params, part.unflatten(flat).values()):
                p.data = view
            self.flat_params.append(flat)
            if stage == 1:
                # Full gradients as views into one flat buffer per part (autograd accumulates
                # into them); the reduce-scatter writes the shard's sum in place.
                flat_grad = torch.zeros_like(flat)
                for p, view in zip(part.params, part.unflatten(flat_grad).values()):
                    p.grad = view
                self.flat_grads.append(flat_grad)
                grad_shards.append(flat_grad[part.lo: part.hi])
            else:
                grad_shards.append(torch.zeros(part.shard_numel, dtype=part.dtype, device=part.device))
                for p in part.params:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.grad_shards = grad_shards
        self.optimizer = ShardAdamW(self.parts, [f[part.lo: part.hi] for f, part in zip(self.flat_params, self.parts)],
                                    grad_shards, lr, weight_decay)
        self.reduction = GradReduceScatter(self.parts, grad_shards, dp_comm, self.meter)  # stage 2
        self._next_to_launch = 0
        log.info("zero%d: %d parts, padded sizes %s, shard %d elements", stage, len(self.parts),
                 [p.padded for p in self.parts], sum(p.shard_numel for p in self.parts))

    # -- gradient sync (the dp.py interface) -----------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradients (in place: stage 1's are views), and start this step's peak from
        what is held now (measured)."""
        for g in self.flat_grads if self.stage == 1 else self.grad_shards:
            g.zero_()
        self.meter.current = self.persistent_bytes()
        self.meter.reset_peak()

    def arm(self, last_microbatch: bool) -> None:
        if self.stage == 2:
            self.reduction.wait()  # the previous microbatch's, if any
            self._next_to_launch = 0
            for part in self.parts:
                part.waiting = len(part.params)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Stage 2: copy the new gradient into its part's flat buffer and drop it; when the part
        is complete, start its reduce-scatter (parts strictly in backward order on every rank)."""
        index, i = self._where[param]
        self.reduction.take(index, i, param)
        order = list(range(len(self.parts) - 1, -1, -1))  # backward runs the parts last to first
        while self._next_to_launch < len(order) and self.parts[order[self._next_to_launch]].waiting == 0:
            self.reduction.launch(order[self._next_to_launch])
            self._next_to_launch += 1

    def finish(self) -> None:
        if self.stage == 1:
            handles = [self.comm.reduce_scatter(g[part.lo: part.hi], g, tag=f"zero/grad_reduce_scatter/{part.name}", async_op=True)
                       for part, g in zip(self.parts, self.flat_grads)]
            for h in handles:
                h.wait()
            return
        if self._next_to_launch != len(self.parts):
            stuck = [p.name for p in self.parts if p.waiting]
            raise RuntimeError(f"zero2: parts {stuck} got no gradient for some parameter in backward "
                               "(every parameter must take part in the loss)")
        self.reduction.wait()

    # -- the optimizer ---------------------------------------------------------------------------
    def step(self) -> None:
        self.optimizer.step()
        handles = []
        for part, flat in zip(self.parts, self.flat_params):
            shard = flat[part.lo: part.hi].clone()  # the input must not alias the output
            self.meter.add(part.shard_nbytes)
            handles.append((part, shard, self.comm.all_gather_into(flat, shard, tag=f"zero/param_all_gather/{part.name}",
                                                                   async_op=True)))
        for part, _shard, h in handles:
            h.wait()
            self.meter.sub(part.shard_nbytes)

    # -- what this rank holds ----------------------------------------------------------------------
    def grad_tensors(self) -> list[torch.Tensor]:
        return self.flat_grads if self.stage == 1 else self.grad_shards

    def state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def persistent_bytes(self) -> int:
        return (storage_bytes(self.flat_params) + storage_bytes(self.grad_tensors())
                + storage_bytes(self.optimizer.state_tensors()))

    def memory(self) -> dict:
        return {
            "param_bytes": storage_bytes(p for part in self.parts for p in part.params),
            "grad_bytes": storage_bytes(self.grad_tensors()),
            "optimizer_bytes": storage_bytes(self.optimizer.state_tensors()),
            "peak_model_state_bytes": self.meter.peak,
        }

    # -- checkpoints -------------------------------------------------------------------------------
    def full_optimizer_state(self) -> dict:
        return gather_optimizer_state(self.parts, self.optimizer, self.comm)

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        """Each rank copies in its part of the full dicts (no communication)."""
        with torch.no_grad():
            for part, flat in zip(self.parts, self.flat_params):
                flat.copy_(part.flatten([model_state[n] for n in part.names]))
            if optim_state is not None:
                self.optimizer.adamw.step_count = int(optim_state["step"])
                for i, part in enumerate(self.parts):
                    for key in ("exp_avg", "exp_avg_sq"):
                        full = part.flatten([optim_state["state"][n][key] for n in part.names])
                        self.optimizer.load_shard_state(i, key, full[part.lo: part.hi])


class ZeroDataParallel(Strategy):
    """`zero1` and `zero2`: the whole model on every rank, the optimizer a ZeroOptimizer over dp."""

    def __init__(self, model: nn.Module, dp_comm: Communicator, stage: int, lr: float, weight_decay: float):
        self.zero = ZeroOptimizer(list(model.named_parameters()), dp_comm, stage, lr, weight_decay)
        super().__init__(model, self.zero, loss_comm=dp_comm)
        self.name = f"zero{stage}"

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def backward_context(self, last_microbatch: bool):
        self.zero.arm(last_microbatch)
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        self.zero.finish()

    def memory_report(self) -> dict:
        return self.zero.memory()

    def full_grads(self) -> dict:
        shards = [g[part.lo: part.hi] if self.zero.stage == 1 else g for part, g in zip(self.zero.parts, self.zero.grad_tensors())]
        return {"grads": _gather_full(self.zero.parts, shards, self.zero.comm, "tooling/full_grads"), "tp_replica_max_diff": {}}

    def full_optimizer_state(self) -> dict:
        return self.zero.full_optimizer_state()

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        self.zero.load_full_state(model_state, optim_state)

    def close(self) -> None:
        self.zero.comm.wait_all()
