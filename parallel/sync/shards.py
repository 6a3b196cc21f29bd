"""The machinery ZeRO is made of: each model part as one flat buffer padded to a multiple of the dp
size, an AdamW over this rank's shard of every part, and the reduce-scatter of gradients into it.

See parallel/zero/__init__.py for what the stages keep where.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.algebra import padded
from parallel.core.model import part_of
from parallel.core.optim import AdamW
from parallel.dist.comm import Communicator

BETAS, EPS = (0.9, 0.95), 1e-8  # as strategy.make_optimizer


class MemoryMeter:
    """Model-state bytes held now and at most, counted from the tensors allocated and freed.

    At the start of each step `current` is set to the persistent tensors (parameters, gradients
    and optimizer state a rank keeps between steps), measured; transients (gathered parameters,
    full gradients of a part before its reduce-scatter, communication buffers) are added when
    allocated and taken off when freed.
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
        self.padded = padded(self.numel, world)  # the smallest multiple of world that holds it
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
            by_part.setdefault(part_of(name), []).append((name, p))
    return [Part(name, params, world, rank) for name, params in by_part.items()]


class ShardAdamW:
    """AdamW over the shards of several parts: each part's shard cut into pieces (Part.pieces),
    every piece a view into the shard, stepped by parallel/core/optim.py's AdamW in the weight-decay
    group of its parameter."""

    def __init__(self, parts: list[Part], shards: list[torch.Tensor], grad_shards: list[torch.Tensor],
                 lr: float, weight_decay: float):
        decay, no_decay = [], []
        self.pieces: list[list[torch.Tensor]] = []  # per part, its pieces in shard order
        self.decays: list[list[float]] = []  # per part, each piece's weight decay
        for part, shard, grad in zip(parts, shards, grad_shards):
            views = []
            for a, b, decays in part.pieces():
                view = shard[a:b]
                view.grad = grad[a:b]
                (decay if decays else no_decay).append(view)
                views.append(view)
            self.pieces.append(views)
            self.decays.append([weight_decay if decays else 0.0 for _, _, decays in part.pieces()])
        self.adamw = AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=lr, betas=BETAS, eps=EPS)

    def step(self) -> None:
        self.adamw.step()

    def step_by_part(self):
        """The same step, one part at a time: yields each part's index once its shard is updated
        (AdamW is elementwise, so the order of the pieces changes no bit of the result)."""
        self.adamw.begin_step()
        for index, (views, decays) in enumerate(zip(self.pieces, self.decays)):
            for view, decay in zip(views, decays):
                self.adamw.update(view, decay)
            yield index

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


def gather_full(parts: list[Part], shards: list[torch.Tensor], comm: Communicator, tag: str) -> dict[str, torch.Tensor]:
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
        handle = self.comm.reduce_scatter(out, self.buffers[index],
                                          tag=f"zero/grad_reduce_scatter/{self.parts[index].name}", async_op=True)
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
        for name, t in gather_full(parts, shards, comm, f"tooling/checkpoint/{key}").items():
            state.setdefault(name, {})[key] = t
    return {"step": optimizer.step_count, "state": state}
