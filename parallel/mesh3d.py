"""Any dp x tp x pp layout on one mesh: pipeline stages whose blocks are tensor-parallel, dp on top.

The world is the (pp, dp, tp) device mesh of parallel/dims.py, rank = (pp·dp + dp_i)·tp + tp_i:
tp innermost, so the ranks of one tensor-parallel group are neighbours (one node, the fast links),
and pp outermost (the pipeline's point-to-point traffic is the lightest and may cross nodes).
Every rank sits in three groups and each carries one kind of traffic:

* tp (same stage, same dp slice): the Megatron collectives inside the stage's blocks, the
  vocab-parallel embedding (first stage) and loss (last stage), and under sequence parallelism
  the once-per-step sum of the sequence-sharded gradients;
* pp (same dp slice, same tp rank): activations forward and their gradients backward. Tp rank i of
  one stage sends to tp rank i of the next: the full b·s·h (every tp rank holds the whole residual
  stream between regions), or under sequence parallelism only its piece of the sequence,
  b·(s/tp)·h, which is exactly what the next stage's tp rank i needs (Megatron does the same);
* dp (same stage, same tp rank): the gradients of this rank's shard of its stage, once per step;
  or, with parallel.zero = 1 or 2, ZeRO over the dp group (parallel/zero.py's ZeroOptimizer on
  the stage's local tp pieces): gradients reduce-scattered, each dp rank steps its 1/dp of the
  stage's optimizer state (stage 2: and keeps only that share of the gradients), the updated
  parameters all-gathered.

The model is built whole from the seed, then transformed in the design's order: tensor
parallelism first (`parallelize_tp`, which also names every tp collective after the global layer
index), then the pipeline cut (`split_model`), then the dp gradient sync over the stage's own
parameters. The schedule runner is parallel/pp/executor.py's, unchanged; this class only says what
crosses a boundary, how the last stage computes its loss and which gradients are summed where.
"""

from __future__ import annotations

import contextlib

import torch

from .comm import Communicator
from .data import Batch
from .dp import make_grad_sync
from .model import GPT, token_loss_sum
from .pp.executor import PipelineParallel
from .tp import SEQ_DIM, TPShards, all_gather_along, parallelize_tp, sum_sequence_partial_grads
from .tp_loss import vocab_parallel_loss_sum
from .zero import ZeroOptimizer, _gather_full

GATHER_TAG = "tooling/gather_params"


def shard_of(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """Tp rank `rank`'s piece of a full tensor cut along `dim` (None: replicated, the whole tensor)."""
    if dim is None or size == 1:
        return full.detach().clone()
    n = full.shape[dim] // size
    return full.detach().narrow(dim, rank * n, n).contiguous().clone()


class Mesh3D(PipelineParallel):
    name = "3d"

    def __init__(self, model: GPT, *, tp_comm: Communicator | None, pp_comm: Communicator, dp_comm: Communicator | None,
                 sequence_parallel: bool, grad_sync: str, bucket_mb: float, schedule: str, microbatches: int,
                 virtual: int, pp_layers: list[int] | None, lr: float, weight_decay: float, zero: int = 0):
        full_parameters = sum(p.numel() for p in model.parameters())
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        self.sequence_parallel = sequence_parallel and self.tp_comm is not None
        self.grad_sync_kind, self.bucket_mb = grad_sync, bucket_mb  # read by _make_grad_sync below
        self.zero_stage, self.lr, self.weight_decay = zero, lr, weight_decay
        self.zero: ZeroOptimizer | None = None  # set by _make_grad_sync when the dp dimension is ZeRO
        # Tensor parallelism first, on the whole model: the shards keep the single-process names
        # and the tp tags the global layer index, whichever stage a block then lands on.
        self.shards = parallelize_tp(model, self.tp_comm, self.sequence_parallel) if self.tp_comm else TPShards(0)
        super().__init__(model, pp_comm=pp_comm, dp_comm=dp_comm, schedule=schedule, microbatches=microbatches,
                         virtual=virtual, pp_layers=pp_layers, lr=lr, weight_decay=weight_decay)
        self._full_parameters = full_parameters
        mine = dict(self.global_named_parameters())
        # This stage's share of the sequence-sharded replicated parameters (its blocks' norms and
        # row-parallel biases; the positions on the first stage, the final norm on the last).
        self.sequence_partial = [mine[n] for n in self.shards.sequence_partial if n in mine]

    # -- the pipeline's hooks -------------------------------------------------------------------
    def _make_grad_sync(self, dp_comm: Communicator | None):
        """The one place the dp dimension's gradient sync is made: plain (an all-reduce of the
        stage's gradients) or ZeRO-1/2, whose ZeroOptimizer is the sync and the optimizer in one."""
        if dp_comm is None or dp_comm.size == 1:
            return None
        if self.zero_stage:
            # Over the stage's local pieces under their full-model names: its parts are the
            # embedding, blocks and head this stage holds, each cut over tp, padded to a multiple of dp.
            self.zero = ZeroOptimizer(self.global_named_parameters(), dp_comm, self.zero_stage, self.lr, self.weight_decay)
            self.optimizer = self.zero  # what the executor steps; the AdamW made for the stage is dropped unused
            return self.zero
        return make_grad_sync(self.model, dp_comm, self.grad_sync_kind, self.bucket_mb)

    def _activation_shape(self, mb: Batch) -> tuple[int, ...]:
        seq = mb.inputs.shape[SEQ_DIM]
        if self.sequence_parallel:
            seq //= self.tp_comm.size  # each tp rank holds and sends its piece of the sequence
        return (mb.n_sequences, seq, self.d_model)

    def _stage_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp_comm is None:
            return token_loss_sum(out, targets)
        # The head is vocab-parallel: `out` is this rank's slice of the logits, never gathered.
        return vocab_parallel_loss_sum(out, targets, self.shards.vocab_start, self.tp_comm)

    def zero_grad(self) -> None:
        if self.zero is not None:
            self.zero.zero_grad()  # in place: stage 1's gradients are views into its flat buffers
        elif self.grad_sync is not None:
            self.grad_sync.zero_grad(self.optimizer)  # the bucketed sync zeroes its buffers in place
        else:
            super().zero_grad()

    def backward_context(self, last_microbatch: bool):
        # With one chunk per rank the last microbatch's backward is the rank's last one, and every
        # parameter of the stage gets its final gradient there: the bucketed sync overlaps with it.
        # (plan.py refuses the bucketed sync with virtual stages, whose chunks finish apart.)
        if self.grad_sync is not None:
            self.grad_sync.arm(last_microbatch)
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        if self.zero is not None:
            # ZeRO-1 reduce-scatters here, and a shard must hold completed gradients: the tp sum
            # of the sequence-sharded ones comes first (plan.py refuses ZeRO-2, which reduces
            # inside backward, with sequence parallelism).
            self._sum_sequence_partial_over_tp()
            super().after_backward()
            return
        super().after_backward()  # the dp sync: finish its all-reduces
        # Sums over tp and over dp commute; the tp sum of the sequence-sharded gradients comes
        # after the dp sync has finished so that it never races a bucket on the wire.
        self._sum_sequence_partial_over_tp()

    def _sum_sequence_partial_over_tp(self) -> None:
        sum_sequence_partial_grads(self.sequence_partial, self.tp_comm)

    def memory_report(self) -> dict:
        return self.zero.memory() if self.zero is not None else super().memory_report()

    # -- the whole model, for tests and checkpoints -----------------------------------------------
    def _tp_rank_and_size(self) -> tuple[int, int]:
        return (self.tp_comm.rank, self.tp_comm.size) if self.tp_comm is not None else (0, 1)

    def _gather_tp(self, tensors: dict[str, torch.Tensor], param_of=lambda key: key) -> dict[str, torch.Tensor]:
        """key -> this rank's piece, to key -> the full tensor (on every tp rank); `param_of(key)` is
        the parameter whose cut the tensor shares (the key itself, or e.g. `name/exp_avg` -> name)."""
        out = {}
        for key, t in tensors.items():
            dim = self.shards.split_dim.get(param_of(key))
            if dim is not None and self.tp_comm is not None:
                t = all_gather_along(self.tp_comm, t.detach(), dim, GATHER_TAG)
            out[key] = t.detach().cpu().clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective; the whole model under single-process names, valid on rank 0."""
        whole_stage = self._gather_tp({n: p for n, p in self.global_named_parameters()})
        return self._gather_to_first_stage(whole_stage, "tooling/state")

    def _synced_local_grads(self) -> dict[str, torch.Tensor]:
        """This rank's tp pieces' gradients as the optimizer saw them; under ZeRO only the dp shards
        hold the synced sums, so they are gathered over dp first (collective)."""
        if self.zero is None:
            return {n: p.grad for n, p in self.global_named_parameters()}
        z = self.zero
        shards = [g[part.lo: part.hi] if z.stage == 1 else g for part, g in zip(z.parts, z.grad_tensors())]
        return _gather_full(z.parts, shards, z.comm, "tooling/full_grads")

    def full_grads(self) -> dict:
        named = self.global_named_parameters()
        local = self._synced_local_grads()
        grads = self._gather_to_first_stage(self._gather_tp(local), "tooling/grads")
        spread = {}
        if self.tp_comm is not None:
            for name, p in named:
                if name not in self.shards.split_dim:
                    copies = all_gather_along(self.tp_comm, local[name].detach().unsqueeze(0), 0, GATHER_TAG)
                    spread[name] = float((copies - copies[0]).abs().max())
        return {"grads": grads, "tp_replica_max_diff": self._gather_to_first_stage(spread, "tooling/grads")}

    # This rank's optimizer state, by name: its tp pieces of its stage's parameters. The two methods
    # below are all a sharded dp optimizer (ZeRO-1/2) replaces: it gathers its dp shards into these
    # same pieces (collective over dp), and cuts its shard back out of them.
    def _stage_optimizer_state(self) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
        if self.zero is not None:
            gathered = self.zero.full_optimizer_state()
            return gathered["step"], gathered["state"]
        local = {}
        for name, p in self.global_named_parameters():
            state = self.optimizer.state.get(p)
            if state is not None:  # every parameter has state after the first step, none before
                local[name] = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
        return self.optimizer.step_count, local

    def _load_stage_optimizer_state(self, step: int, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.zero is not None:
            self.zero.optimizer.adamw.step_count = step
            for i, part in enumerate(self.zero.parts):
                for key in ("exp_avg", "exp_avg_sq"):
                    full = part.flatten([pieces[name][key] for name in part.names])
                    self.zero.optimizer.load_shard_state(i, key, full[part.lo: part.hi])
            return
        self.optimizer.step_count = step
        self.optimizer.state = {p: {k: t.to(p.device) for k, t in pieces[name].items()}
                                for name, p in self.global_named_parameters() if name in pieces}

    def full_optimizer_state(self) -> dict:
        """Collective; {"step", "state": {name: {"exp_avg", "exp_avg_sq"}}} whole, valid on rank 0."""
        step, local = self._stage_optimizer_state()
        pieces = {f"{name}/{k}": t for name, moments in local.items() for k, t in moments.items()}
        whole = self._gather_tp(pieces, param_of=lambda key: key.rsplit("/", 1)[0])
        merged = self._gather_to_first_stage(whole, "tooling/optim_state")
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in merged.items():
            name, k = key.rsplit("/", 1)
            state.setdefault(name, {})[k] = t
        return {"step": step, "state": state}

    def load_full_state(self, model_state: dict[str, torch.Tensor], optim_state: dict | None = None) -> None:
        """Every rank gets the whole dicts and keeps its own piece; no collectives."""
        rank, size = self._tp_rank_and_size()
        named = self.global_named_parameters()
        with torch.no_grad():
            for name, p in named:
                p.copy_(shard_of(model_state[name], self.shards.split_dim.get(name), rank, size))
        if optim_state is None:
            return
        mine = {name for name, _ in named}
        pieces = {name: {k: shard_of(full[k], self.shards.split_dim.get(name), rank, size) for k in ("exp_avg", "exp_avg_sq")}
                  for name, full in optim_state["state"].items() if name in mine}
        self._load_stage_optimizer_state(int(optim_state["step"]), pieces)

    def close(self) -> None:
        super().close()  # waits on dp_comm too: ZeRO's collectives are on it
        if self.tp_comm is not None:
            self.tp_comm.wait_all()
