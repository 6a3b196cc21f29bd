"""ZeroOptimizer: ZeRO stage 1 or 2 over one data-parallel group, the gradient sync and the optimizer in one."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from parallel.dist.comm import Communicator
from parallel.strategy import GradSync, storage_bytes
from parallel.sync.lowprec import collectives
from parallel.sync.shards import (
    GradReduceScatter,
    MemoryMeter,
    ShardAdamW,
    gather_full,
    gather_optimizer_state,
    group_into_parts,
)

log = logging.getLogger(__name__)


class ZeroOptimizer(GradSync):
    """ZeRO stage 1 or 2 over one data-parallel group: the gradient sync and the optimizer in one.

    Built from the local parameters under their full-model names (a whole model, a tensor-parallel
    shard or a pipeline stage alike) and the dp Communicator. The gradient-sync protocol
    (strategy.GradSync), plus the optimizer's interface:

        zero_grad()                  before a step's first microbatch
        before_microbatch(last)      before each microbatch's backward
        finish()                     after the last microbatch's backward: gradient shards ready
        step()                       step the own shard, all-gather the updated parameters
        state_bytes(), memory()      what this rank holds
        full_optimizer_state()       the whole model's Adam moments (collective)
        load_full_state(m, o)        copy in this rank's part of full dicts (no communication)

    Stage 1 runs the sync's completions (sequence parallelism's sum of partial gradients over tp)
    before its reduce-scatter, since each rank keeps only a shard of the sum. Stage 2 reduces each
    part in backward hooks, as soon as the part has all its gradients of this backward; it runs the
    completions there, on that part's gradients, just before its reduce-scatter (so once per
    microbatch: the price of never holding a whole gradient). A part is reduced whenever its
    gradients are in, so a pipeline rank's chunks, whose backwards run at different moments of the
    schedule, each reduce their own parts; every dp rank runs the same schedule, so the
    reduce-scatters come in the same order on all of them.

    The gradients' reduce-scatters go through `grad_comm`, in parallel.comm_dtype
    (parallel/sync/lowprec.py); the parameters' all-gather stays fp32 on `comm`, since the gathered
    copy is the one this optimizer trains.

    After construction the parameters are views into per-part flat buffers (their values are
    unchanged); the model is used as before.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], dp_comm: Communicator, stage: int,
                 lr: float, weight_decay: float, comm_dtype: str = "fp32"):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles ZeRO stages 1 and 2, not {stage} (zero3 is Zero3)")
        super().__init__([p for _, p in named_params if p.requires_grad])
        self.stage = stage
        self.comm = dp_comm
        self.meter = MemoryMeter()
        self.grad_comm = collectives(dp_comm, comm_dtype, meter=self.meter)  # the gradients' reduce-scatters
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
        self.reduction = GradReduceScatter(self.parts, grad_shards, self.grad_comm, self.meter)  # stage 2
        self.reduced = [0] * len(self.parts)  # stage 2: each part's reduce-scatters this step
        log.info("zero%d: %d parts, padded sizes %s, shard %d elements", stage, len(self.parts),
                 [p.padded for p in self.parts], sum(p.shard_numel for p in self.parts))

    # -- gradient sync (the dp.py interface) -----------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradients (in place: stage 1's are views), and start this step's peak from
        what is held now (measured)."""
        for g in self.flat_grads if self.stage == 1 else self.grad_shards:
            g.zero_()
        for part in self.parts:
            part.waiting = len(part.params)
        self.reduced = [0] * len(self.parts)
        self.meter.current = self.persistent_bytes()
        self.meter.reset_peak()

    def before_microbatch(self, last: bool) -> None:
        if self.stage == 2:
            self.reduction.wait()  # the previous backward's, if any

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Stage 2: copy the new gradient into its part's flat buffer and drop it; when the part
        has all of them, complete and reduce it."""
        index, i = self._where[param]
        self.reduction.take(index, i, param)
        if self.parts[index].waiting == 0:
            self._reduce(index)

    def _reduce(self, index: int) -> None:
        """Stage 2: complete a full part's partial gradients over the other group (in its flat
        buffer: a shard of a sum over dp cannot be completed by summing whole gradients over tp
        later), then start its reduce-scatter, and wait for the next backward's gradients."""
        part = self.parts[index]
        if self.completions:
            views = part.unflatten(self.reduction.buffers[index])
            grads = [views[name] for name in part.names]
            for completion in self.completions:
                completion.of(part.params, grads)
        self.reduction.launch(index)
        part.waiting = len(part.params)
        self.reduced[index] += 1

    def finish(self) -> None:
        if self.stage == 1:
            self.complete()  # a shard must hold the sum of complete gradients
            handles = [self.grad_comm.reduce_scatter(g[part.lo: part.hi], g,
                                                     tag=f"zero/grad_reduce_scatter/{part.name}", async_op=True)
                       for part, g in zip(self.parts, self.flat_grads)]
            for h in handles:
                h.wait()
            return
        stuck = [p.name for p, n in zip(self.parts, self.reduced)
                 if p.waiting != len(p.params) or n != max(self.reduced) or not n]
        if stuck:
            raise RuntimeError(f"zero2: parts {stuck} got no gradient for some parameter in some backward "
                               "(every parameter must take part in the loss)")
        self.reduction.wait()

    # -- the optimizer ---------------------------------------------------------------------------
    def step(self) -> None:
        """Step the shard part by part, each part's all-gather posted as soon as its shard is
        updated: the gathers of the first parts run while the optimizer works on the later ones
        (as FSDP2 overlaps its own gathers with compute), and the step waits for them at its end."""
        handles = []
        for index in self.optimizer.step_by_part():
            part, flat = self.parts[index], self.flat_params[index]
            shard = flat[part.lo: part.hi].clone()  # the input must not alias the output
            self.meter.add(part.shard_nbytes)
            handles.append((part, shard,
                            self.comm.all_gather_into(flat, shard, tag=f"zero/param_all_gather/{part.name}",
                                                      async_op=True)))
        for part, _shard, h in handles:
            h.wait()
            self.meter.sub(part.shard_nbytes)

    # -- what this rank holds ----------------------------------------------------------------------
    def grad_tensors(self) -> list[torch.Tensor]:
        return self.flat_grads if self.stage == 1 else self.grad_shards

    def synced_grad_shards(self) -> list[torch.Tensor]:
        """Per part, this rank's shard of the summed gradient (what the optimizer steps with)."""
        if self.stage == 1:
            return [g[part.lo: part.hi] for part, g in zip(self.parts, self.flat_grads)]
        return self.grad_shards

    def synced_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's summed gradient, gathered over the group from the shards (collective)."""
        return gather_full(self.parts, self.synced_grad_shards(), self.comm, "tooling/full_grads")

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
        """Adam's moments of every parameter this optimizer was built with, whole (collective over dp)."""
        return gather_optimizer_state(self.parts, self.optimizer, self.comm)

    def named_state(self, named_params) -> dict:
        """AdamW.named_state's contract, for the parameters this optimizer holds (collective over dp)."""
        mine = {name for part in self.parts for name in part.names}
        assert {name for name, _ in named_params} == mine, \
            "ZeroOptimizer.named_state: not the parameters it was built with"
        return self.full_optimizer_state()

    def load_named_state(self, named_params, state: dict, local_part=lambda name, t: t) -> None:
        """AdamW.load_named_state's contract: moments given whole per parameter, this rank keeps its shard."""
        names = [name for part in self.parts for name in part.names]
        missing = [n for n in names if n not in state["state"]]
        if int(state["step"]) > 0 and missing:
            raise KeyError(f"the optimizer state has taken {state['step']} steps but holds no Adam moments for "
                           f"{len(missing)} parameter(s), e.g. {missing[:3]}: it was saved under other names")
        moments = {n: {k: local_part(n, t) for k, t in state["state"][n].items()} for n in names if n in state["state"]}
        if len(moments) == len(names):
            self.load_moments(int(state["step"]), moments)

    def load_full_state(self, model_state: dict, optim_state: dict | None) -> None:
        """Each rank copies in its part of the full dicts (no communication); `model_state` and the
        moments are keyed by the names this optimizer was built with (whole tensors of its
        parameters, which may themselves be tp pieces)."""
        with torch.no_grad():
            for part, flat in zip(self.parts, self.flat_params):
                flat.copy_(part.flatten([model_state[n] for n in part.names]))
        if optim_state is not None:
            self.load_moments(int(optim_state["step"]), optim_state["state"])

    def load_moments(self, step: int, moments: dict[str, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's shard of Adam's moments, given whole per parameter name."""
        self.optimizer.adamw.step_count = step
        for i, part in enumerate(self.parts):
            for key in ("exp_avg", "exp_avg_sq"):
                full = part.flatten([moments[n][key] for n in part.names])
                self.optimizer.load_shard_state(i, key, full[part.lo: part.hi])
