"""What every strategy does in one optimizer step, and the single-process reference.

One step: for each microbatch, forward, loss, backward (gradients accumulate); then whatever
synchronisation the strategy needs; then the optimizer. The loss of every microbatch is its
summed token loss divided by the number of tokens in the *global* batch, so the gradients add up
to the gradient of the global mean loss however the batch is split. That is why the strategies
sum gradients across ranks (never average them) and why their losses match the single run.

Two contracts every strategy keeps, whatever its layout:

* Before its optimizer step it calls `guard_finite(local_loss)`: one tiny all-reduce over the
  world says whether any rank's loss is NaN or inf, and if so every rank raises `NonFiniteLoss`
  before a single weight or moment is overwritten.
* Checkpoints are layout-free: `full_state_dict` and `full_optimizer_state` give the whole model
  and its Adam moments under single-process names (collective, valid on rank 0), and
  `load_full_state` takes those same dicts on every rank and keeps this rank's part of them.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn as nn

from parallel.core.data import Batch
from parallel.core.model import training_loss_sum
from parallel.core.optim import SGD, AdamW, Optimizer
from parallel.core.phases import PhaseLog
from parallel.dist.comm import Communicator


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a freed
    storage, resized to 0, counts 0): what a rank really holds, not what the shapes suggest."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def moment_param(key: str) -> str:
    """`blocks.0.attn.q.weight/exp_avg` -> `blocks.0.attn.q.weight`: a moment is cut like its parameter."""
    return key.rsplit("/", 1)[0]


def flat_moments(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: {"exp_avg": t}} -> {`name/exp_avg`: t}: moments as tensors that gather like their parameter."""
    return {f"{name}/{k}": t for name, moments in state.items() for k, t in moments.items()}


def nest_moments(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{`name/exp_avg`: t} -> {name: {"exp_avg": t}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, moment = key.rsplit("/", 1)
        out.setdefault(name, {})[moment] = t
    return out


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, kind: str = "adamw") -> Optimizer:
    """AdamW (or plain SGD: `train.optimizer=sgd`, parallel/core/optim.py); no weight decay on biases
    and LayerNorm weights (the nanoGPT/GPT-2 convention)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "sgd":
        return SGD(groups, lr=lr)
    return AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def plan_optimizer(model: nn.Module, plan) -> Optimizer:
    """The run's optimizer for `model` (the whole model, or the part of it this rank holds): the
    plan's train.optimizer, lr and weight decay."""
    return make_optimizer(model, plan.lr, plan.weight_decay, plan.optimizer)


class Completion:
    """A sum over another group that completes some parameters' gradients (tp's, of the norms under
    sequence parallelism): `sum_in_place(grads)` sums the gradients given, one per parameter of any
    subset of `params` in their order, over that group. Called with nothing, it completes `.grad`
    of all of them; `of(params, grads)` completes those of its own among a part's gradients
    elsewhere (ZeRO-2's flat buffer)."""

    def __init__(self, params: list[nn.Parameter], sum_in_place):
        self.params = params
        self.members = set(params)
        self.sum_in_place = sum_in_place

    def __call__(self) -> None:
        self.sum_in_place([p.grad for p in self.params])

    def of(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        self.sum_in_place([g for p, g in zip(params, grads) if p in self.members])


class GradSync:
    """The gradient-sync protocol, and its no-op default: gradients stay where backward left them.

    Every way of combining gradients across ranks (plain dp, naive or bucketed; ZeRO-1/2; the dp
    dimension of tp and of a pipeline) implements these three moments of a step:

        zero_grad()                  before the step's first microbatch
        before_microbatch(last)      before each microbatch's backward; `last`: the step's last
                                     microbatch, whose backward may start communicating
        finish()                     after the last backward: every gradient is final here

    `completions` (`Completion`) complete local gradients across *another* group before they are
    used (sequence parallelism's sum of partial LayerNorm and bias gradients over tp). Each sync runs
    them where that is right for its own reduction: a plain sum commutes with them, so after its
    all-reduces have landed (never while a bucket is on the wire); a reduce-scatter before it, since
    each rank keeps only a shard of what it reduces: once per step before ZeRO-1's, and before each
    of ZeRO-2's, on the gradients of the part it is about to reduce.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.completions: list[Completion] = []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def before_microbatch(self, last: bool) -> None:
        pass

    def finish(self) -> None:
        self.complete()

    def complete(self) -> None:
        for complete in self.completions:
            complete()

    def synced_grads(self) -> dict[str, torch.Tensor] | None:
        """This rank's gradients as the optimizer used them, by name, where the sync keeps them
        elsewhere than in `.grad` (ZeRO keeps only its shard of each sum: gathered here, a collective);
        None where backward's `.grad` is what the optimizer used."""
        return None

    def memory(self) -> dict | None:
        """The model state the sync holds, where it owns it (ZeRO's flat parts and shard optimizer);
        None where the strategy's parameters and optimizer are what it counts."""
        return None


class ParameterCut(Protocol):
    """How a strategy's parameters are cut into pieces across a group, and back (tensor
    parallelism's `TPShards`: a runner that may or may not be cut, a pipeline stage, reads its
    parameters through this and never asks which family cut them)."""

    def gather(self, tensors: dict[str, torch.Tensor], param_of=...) -> dict[str, torch.Tensor]:
        """key -> this rank's piece, to key -> the full tensor on the CPU (a collective over the cut)."""

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor."""

    def replica_spread(self, grads: dict[str, torch.Tensor]) -> dict[str, float]:
        """For each parameter that is not cut, the largest difference of its gradient across the cut's ranks."""


class NonFiniteLoss(ArithmeticError):
    """Some rank's loss is NaN or inf; raised on every rank before the optimizer step."""

    def __init__(self, local_loss: float):
        super().__init__(f"this rank's share of the loss is {local_loss}")
        self.local_loss = local_loss


class Strategy:
    """Base: a model, its optimizer, and the step loop with hooks for gradient synchronisation."""

    name = "single"
    # The world communicator that `guard_finite` reduces its verdict over (None: one process, or
    # the check turned off); set by parallel/train.py once the process groups exist.
    finite_comm: Communicator | None = None
    check_finite: bool = True
    finite_checks: int = 0  # how many steps were guarded; train.py checks every step was
    # What this strategy's time breakdown cannot split, and why (summary.json's time_breakdown.notes).
    breakdown_note: str | None = None
    # False where the waits for this strategy's communication happen out of the log's sight (inside
    # DDP's reducer; inside FSDP2 on CUDA): its exposed communication is then not measured.
    exposed_comm_measured: bool = True

    def __init__(self, model: nn.Module, optimizer: Optimizer, loss_comm: Communicator | None = None,
                 sync: GradSync | None = None):
        self.model = model
        self.optimizer = optimizer
        # How gradients are combined across ranks (the no-op GradSync: they stay local).
        self.sync = sync if sync is not None else GradSync([p for p in model.parameters() if p.requires_grad])
        # The group over which the per-rank loss shares add up to the global loss (None: one rank).
        self.loss_comm = loss_comm
        # The context every forward pass runs in: nothing for fp32, autocast for bf16
        # (parallel/core/precision.py; the training loop sets it from train.precision).
        self.forward_context = contextlib.nullcontext
        # Where the step is: forward, backward, sync, optimizer, ... (parallel/core/phases.py).
        self.phases = PhaseLog()

    # The gradient-sync protocol: the three moments of a step where gradients are handled ----------
    def zero_grad(self) -> None:
        self.sync.zero_grad()

    def microbatch_context(self, last_microbatch: bool):
        """Entered around each microbatch's backward (and forward); tells the sync whether this is
        the step's last microbatch, the one whose backward communicates."""
        self.sync.before_microbatch(last_microbatch)
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Called once all microbatches have run backward, before the optimizer."""
        self.sync.finish()

    def forward_loss(self, mb: Batch, global_tokens: int) -> torch.Tensor:
        """This microbatch's share of the global loss: its summed token loss, plus the balancing loss
        of its MoE blocks' routing (a sum over its tokens too; none in a dense model, where this is
        exactly the token loss), over the global batch's token count."""
        return training_loss_sum(self.model, self.model(mb.inputs), mb.targets) / global_tokens

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    # The step ---------------------------------------------------------------------------------
    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        """Run one optimizer step; return this rank's share of the global mean loss (detached)."""
        phase = self.phases
        phase("other", "zero_grad")
        self.zero_grad()
        local_loss = torch.zeros((), device=microbatches[0].inputs.device)
        for i, mb in enumerate(microbatches):
            phase("sync", f"before microbatch {i}")
            with self.microbatch_context(last_microbatch=i == len(microbatches) - 1):
                phase("forward", f"F{i}")
                with self.forward_context():
                    loss = self.forward_loss(mb, global_tokens)
                phase("backward", f"B{i}")
                self.backward(loss)
            local_loss += loss.detach()
        phase("sync", "gradient sync")
        self.after_backward()
        phase("other", "finite check")
        self.guard_finite(local_loss)
        phase("optimizer", "optimizer step")
        self.optimizer.step()
        return local_loss

    def guard_finite(self, local_loss: torch.Tensor) -> None:
        """Stop every rank, before the optimizer, if any rank's loss is not finite.

        Each rank knows only its share of the loss (a dp slice; or nothing, off the last pipeline
        stage), so the verdict is a max-all-reduce of a 0/1 flag over the world: 4 bytes, tagged
        as tooling. A NaN anywhere reaches every rank's gradients through the gradient sync, so
        all ranks must stop together, and they do, since they all see the same flag.
        """
        self.finite_checks += 1
        if not self.check_finite:
            return
        bad = (~torch.isfinite(local_loss.detach())).float().reshape(1)
        if self.finite_comm is not None and self.finite_comm.size > 1:
            self.finite_comm.all_reduce(bad, tag="tooling/finite", op="max")
        if bad.item():
            # Under NCCL a collective the watchdog failed returns when it aborts the communicators,
            # with whatever the buffer held: a flag read after that is no verdict on the loss.
            failed = self.finite_comm.backend_failure("all_reduce", "tooling/finite") if self.finite_comm else None
            if failed is not None:
                raise failed
            raise NonFiniteLoss(float(local_loss))

    def global_loss(self, local_loss: torch.Tensor) -> float:
        """The mean loss over every token of the global batch, on rank 0 (tooling traffic)."""
        if self.loss_comm is not None and self.loss_comm.size > 1:
            self.loss_comm.all_reduce(local_loss, tag="tooling/loss")
        return float(local_loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters, named as in the single-process GPT."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def full_parameter_count(self) -> int:
        """Parameters of the whole model, however it is split across ranks."""
        return sum(p.numel() for p in self.model.parameters())

    # -- checkpoints: the whole state under single-process names ----------------------------------
    def named_full_parameters(self):
        """(single-process name, parameter) for what this rank holds (here: the whole model)."""
        return self.model.named_parameters()

    def full_optimizer_state(self) -> dict:
        """{"step": optimizer steps taken, "state": {name: {"exp_avg": full, "exp_avg_sq": full}}}.

        Replicated strategies hold the whole state on every rank: rank 0 just copies its own.
        """
        return self.optimizer.named_state(self.named_full_parameters())

    def checkpoint_pieces(self):
        """The state this rank alone holds, as pieces of single-process tensors (a RankState of
        parallel/sync/pieces.py), for a sharded save (parallel/reliability/sharded.py); None where
        the strategy holds no shards of its own (replicas, model-parallel cuts: a sharded save then
        gathers to rank 0)."""
        return None

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor named `name` (the whole of it, unless sharded)."""
        return full

    @torch.no_grad()
    def load_full_state(self, model_state: dict[str, torch.Tensor], optim_state: dict) -> None:
        """Keep this rank's part of a whole-model checkpoint; every rank calls it, no collectives."""
        named = list(self.named_full_parameters())
        for name, p in named:
            p.copy_(self.local_part(name, model_state[name]))
        self.optimizer.load_named_state(named, optim_state, self.local_part)

    def full_grads(self) -> dict:
        """The whole model's gradients as the optimizer sees them (after every sync), single-process
        names; `tp_replica_max_diff` is filled by strategies that replicate parameters over tp."""
        return {"grads": {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()},
                "tp_replica_max_diff": {}}

    def memory_report(self) -> dict:
        """Model-state bytes this rank holds after a step, measured from its tensors. Here every
        one of them is held for the whole step (gradients from the first backward on), so the
        peak is their sum; the ZeRO strategies track theirs as tensors come and go."""
        params = storage_bytes(self.model.parameters())
        grads = storage_bytes(p.grad for p in self.model.parameters())
        state = storage_bytes(t for s in self.optimizer.state.values() for t in s.values())
        return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state,
                "peak_model_state_bytes": params + grads + state}

    def close(self) -> None:
        """Finish outstanding communication before the process group goes away."""


class SingleProcess(Strategy):
    name = "single"
