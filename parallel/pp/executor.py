"""Run a pipeline schedule for real: the same action lists the simulator checks.

Each rank walks its list. Forward and backward run its chunks; runs of consecutive sends and
receives are posted together (batch_isend_irecv through the communication log), then the
receives are waited on before the compute that needs them, and the sends are waited on at the end
of the step. Activations cross stage boundaries as (microbatch, seq, d_model) fp32 tensors (under
bf16 autocast too: a chunk ends with a block or the embedding, whose residual stream stays fp32).

The loss exists only on the last virtual stage: each microbatch's summed token loss divided by
the global batch's token count, so the gradients equal the single-process ones (dividing by the
microbatch's own count would make them m times too large, the classic mistake). The global mean
loss reaches rank 0 through an all-reduce over pp and then dp, tagged as tooling.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from ..comm import Communicator
from ..data import Batch
from ..dp import NaiveGradSync
from ..model import GPT, token_loss_sum
from ..strategy import Strategy, make_optimizer
from .schedules import COMM, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, build_schedule
from .split import split_model


class PipelineParallel(Strategy):
    name = "pp"

    def __init__(self, model: GPT, *, pp_comm: Communicator, dp_comm: Communicator | None, schedule: str,
                 microbatches: int, virtual: int, pp_layers: list[int] | None, lr: float, weight_decay: float):
        self._full_parameters = sum(p.numel() for p in model.parameters())
        self.stages = pp_comm.size
        self.pp_rank = pp_comm.rank
        self.virtual = virtual
        self.last_vstage = self.stages * virtual - 1
        self.chunks = split_model(model, self.stages, virtual, self.pp_rank, pp_layers)
        local = nn.ModuleList(self.chunks)
        super().__init__(local, make_optimizer(local, lr, weight_decay), loss_comm=dp_comm)
        self.pp_comm = pp_comm
        self.dp_comm = dp_comm
        self.d_model = model.cfg.d_model
        self.schedule = schedule
        self.microbatches = microbatches
        self.actions: list[Action] = build_schedule(schedule, self.stages, microbatches, virtual)[self.pp_rank]
        self.grad_sync = self._make_grad_sync(dp_comm)
        self.executed: list[Action] = []  # the order actually run in the last step (tests compare it with the schedule)
        self.spans: list[dict] = []  # the last step's timeline: one record per action

    def full_parameter_count(self) -> int:
        return self._full_parameters

    def global_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their single-process names."""
        return [(chunk.global_name(n), p) for chunk in self.chunks for n, p in chunk.named_parameters()]

    # -- what a subclass (the 3-D strategy, parallel/mesh3d.py) changes -------------------------
    def _make_grad_sync(self, dp_comm: Communicator | None):
        if dp_comm is None or dp_comm.size == 1:
            return None
        return NaiveGradSync.from_named(self.global_named_parameters(), dp_comm)

    def _activation_shape(self, mb: Batch) -> tuple[int, ...]:
        """What crosses a stage boundary: one microbatch's hidden states."""
        return (mb.n_sequences, mb.inputs.shape[1], self.d_model)

    def _stage_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last virtual stage's summed token loss from its output."""
        return token_loss_sum(out, targets)

    def after_backward(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.finish()

    # -- helpers ----------------------------------------------------------------------------------
    def _vstage(self, a: Action) -> int:
        return a.chunk * self.stages + self.pp_rank

    def _peer(self, vstage: int) -> int:
        return vstage % self.stages  # the pp-group rank that holds a virtual stage

    def _span(self, a: Action, kind: str, start: float, end: float) -> None:
        self.spans.append({"name": str(a), "kind": kind, "mb": a.mb, "chunk": a.chunk, "start": start, "end": end})

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        self.zero_grad()
        self.executed, self.spans = [], []
        device = microbatches[0].inputs.device
        act_shape = self._activation_shape(microbatches[0])
        inputs: dict[tuple[int, int], torch.Tensor] = {}    # received activations (leaves with grad)
        outputs: dict[tuple[int, int], torch.Tensor] = {}   # chunk outputs, or the loss on the last stage
        out_grads: dict[tuple[int, int], torch.Tensor] = {}  # received gradients of the outputs
        sends = []
        local_loss = torch.zeros((), device=device)
        i = 0
        while i < len(self.actions):
            a = self.actions[i]
            if a.op in COMM:
                j = i
                while j < len(self.actions) and self.actions[j].op in COMM:
                    j += 1
                sends += self._exchange(self.actions[i:j], inputs, outputs, out_grads, act_shape, device)
                self.executed += self.actions[i:j]
                i = j
                continue
            key, vs = (a.mb, a.chunk), self._vstage(a)
            chunk = self.chunks[a.chunk]
            start = time.time()
            if a.op == F:
                x = microbatches[a.mb].inputs if vs == 0 else inputs[key]
                with self.forward_context():
                    out = chunk(x)
                    if vs == self.last_vstage:
                        out = self._stage_loss(out, microbatches[a.mb].targets) / global_tokens
                if vs == self.last_vstage:
                    local_loss += out.detach()
                outputs[key] = out
            else:
                out = outputs.pop(key)
                with self.backward_context(last_microbatch=a.mb == self.microbatches - 1):
                    if vs == self.last_vstage:
                        out.backward()
                    else:
                        torch.autograd.backward(out, out_grads.pop(key))
            self._span(a, "forward" if a.op == F else "backward", start, time.time())
            self.executed.append(a)
            i += 1
        start = time.time()
        for handle in sends:
            handle.wait()
        if sends:
            self.spans.append({"name": "wait sends", "kind": "wait", "mb": -1, "chunk": -1, "start": start, "end": time.time()})
        self.after_backward()
        self.guard_finite(local_loss)  # only the last stage has a loss; the flag reaches every stage
        self.optimizer.step()
        return local_loss

    def _exchange(self, batch: list[Action], inputs, outputs, out_grads, act_shape, device) -> list:
        """Post one run of sends and receives together; wait for the receives; return the sends."""
        ops, receives = [], []
        for a in batch:
            key, vs = (a.mb, a.chunk), self._vstage(a)
            if a.op == SEND_F:
                ops.append(("send", outputs[key].detach(), self._peer(vs + 1), f"pp/fwd/{vs}->{vs + 1}"))
            elif a.op == SEND_B:
                ops.append(("send", inputs.pop(key).grad, self._peer(vs - 1), f"pp/bwd/{vs}->{vs - 1}"))
            elif a.op == RECV_F:
                buf = torch.empty(act_shape, device=device)
                inputs[key] = buf
                receives.append(len(ops))
                ops.append(("recv", buf, self._peer(vs - 1), f"pp/fwd/{vs - 1}->{vs}"))
            elif a.op == RECV_B:
                buf = torch.empty(act_shape, device=device)
                out_grads[key] = buf
                receives.append(len(ops))
                ops.append(("recv", buf, self._peer(vs + 1), f"pp/bwd/{vs + 1}->{vs}"))
        label = " ".join(str(a) for a in batch)
        start = time.time()
        handles = self.pp_comm.batch_p2p(ops)
        posted = time.time()
        coalesced = len(handles) != len(ops)
        waited = handles if coalesced else [handles[k] for k in receives]
        for handle in waited:
            handle.wait()
        for a in batch:
            if a.op == RECV_F:
                inputs[(a.mb, a.chunk)].requires_grad_(True)
        # Two spans: posting the sends and receives, then waiting for the receives to arrive.
        self._span(batch[0], "p2p", start, posted)
        self.spans[-1]["name"] = f"post {label}"
        if waited:
            self._span(batch[0], "wait", posted, time.time())
            self.spans[-1]["name"] = f"wait {label}"
        return [] if coalesced else [h for k, h in enumerate(handles) if k not in receives]

    # -- results ----------------------------------------------------------------------------------
    def global_loss(self, local_loss: torch.Tensor) -> float:
        """Only the last stage holds the loss: sum over pp (others add 0), then over dp."""
        if self.stages > 1:
            self.pp_comm.all_reduce(local_loss, tag="tooling/loss")
        return super().global_loss(local_loss)

    def _gather_to_first_stage(self, local: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
        """Every stage's tensors, already under single-process names, merged on pp rank 0."""
        parts = self.pp_comm.gather_object(local, 0, tag=tag)
        merged = {}
        for part in parts or []:
            merged.update(part)
        return merged

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        mine = {chunk.global_name(n): t.detach().cpu().clone() for chunk in self.chunks for n, t in chunk.state_dict().items()}
        return self._gather_to_first_stage(mine, "tooling/state")

    def named_full_parameters(self):
        return [(chunk.global_name(n), p) for chunk in self.chunks for n, p in chunk.named_parameters()]

    def full_optimizer_state(self) -> dict:
        """Each stage's moments under single-process names, merged on pp rank 0."""
        mine = super().full_optimizer_state()["state"]
        parts = self.pp_comm.gather_object(mine, 0, tag="tooling/optimizer_state")
        merged = {}
        for part in parts or []:
            merged.update(part)
        return {"step": self.optimizer.step_count, "state": merged}

    def full_grads(self) -> dict:
        mine = {chunk.global_name(n): p.grad.detach().cpu().clone() for chunk in self.chunks for n, p in chunk.named_parameters()}
        return {"grads": self._gather_to_first_stage(mine, "tooling/grads"), "tp_replica_max_diff": {}}

    def close(self) -> None:
        self.pp_comm.wait_all()
        if self.dp_comm is not None:
            self.dp_comm.wait_all()
