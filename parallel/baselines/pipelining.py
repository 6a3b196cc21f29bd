"""torch.distributed.pipelining on the same chunks: the baselines for our pipeline schedules.

The GPT is cut into exactly the chunks `pp/split.py` gives our executor (same layers per virtual
stage, on the schedule's own placement: chunk c of rank r is virtual stage c·p + r on the loop,
r and 2p-1-r on the V); each becomes a PipelineStage, driven by torch's schedule of the same
order (the schedule record's `torch_class`, parallel/pp/schedules.py): ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, and the zero-bubble ones, ScheduleInterleavedZeroBubble
(ZB-H1 with one stage per rank: its order is our zbh1's), ScheduleZBVZeroBubble and
ScheduleDualPipeV. The V schedules need each rank to hold stages r and 2p-1-r and do not check it
(loop-placed stages crash one rank and hang another), so the stages are built on the V here. The loss is the project's
(summed token loss / global tokens) with scale_grads=False, because that loss is already divided
by the global token count; the optimizer is the project's AdamW over this rank's chunks.

Traffic: torch's schedules post their sends and receives through torch.distributed directly;
counting.PipelineP2PCounter wraps the schedules' batch-posting and waiting functions, so every
send and receive is logged under the "pp" group, and the time blocked waiting for them is the
exposed communication. Torch's one-time metadata exchange on the first step (shapes inferred from
the first microbatch) is setup and not counted. One pipeline over the whole world (dp = 1).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from parallel.baselines.counting import PipelineP2PCounter
from parallel.core.data import Batch
from parallel.core.model import GPT, token_loss_sum
from parallel.dist.comm import CommLog, Communicator
from parallel.pp.schedules import SCHEDULES, ScheduleError, schedule_placement
from parallel.pp.split import split_model
from parallel.strategy import Strategy, make_optimizer


def torch_schedules() -> list[str]:
    """Our schedules that have a torch.distributed.pipelining counterpart (their records' `torch_class`)."""
    return [name for name, s in SCHEDULES.items() if s.torch_class is not None]


def torch_schedule_class(schedule: str):
    from torch.distributed import pipelining

    return getattr(pipelining, SCHEDULES[schedule].torch_class)


def check_torch_schedule(schedule: str, stages: int, microbatches: int, virtual: int) -> None:
    """What torch refuses beyond our schedule's own rules (run_plan.py asks before any process group):
    ScheduleInterleavedZeroBubble runs microbatches in rounds of max(1, m // p) and needs m to be a
    multiple of the number of rounds (torch 2.13, schedules.py)."""
    if schedule not in torch_schedules():
        raise ScheduleError(f"parallel.schedule={schedule!r} has no torch.distributed.pipelining counterpart: "
                            f"choose one of {', '.join(torch_schedules())}")
    rounds = max(1, microbatches // stages)
    if schedule == "zbh1" and microbatches % rounds:
        fits = [n for n in range(microbatches, 0, -1) if n % max(1, n // stages) == 0][0]
        raise ScheduleError(
            f"parallel.microbatches={microbatches}: torch's ScheduleInterleavedZeroBubble runs microbatches in "
            f"{rounds} rounds (m // parallel.pp) and needs m to be a multiple of that: use parallel.microbatches={fits}"
        )


class TorchPipeline(Strategy):
    name = "torch_pp"
    breakdown_note = ("torch's pipeline schedule runs every forward, backward and p2p of a step inside one step() "
                      "call: compute is that call's time less the waits at its p2p wrappers (the bubble), with "
                      "forward and backward not split")

    def __init__(self, model: GPT, schedule: str, pp_comm: Communicator, microbatches: int, virtual: int,
                 pp_layers, lr: float, weight_decay: float, device: torch.device, log: CommLog | None = None):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        self._full_parameters = sum(p.numel() for p in model.parameters())
        p = pp_comm.size
        self.chunks = split_model(model, p, virtual, pp_comm.rank, pp_layers, schedule_placement(schedule, p, virtual))
        local = nn.ModuleList(self.chunks)
        super().__init__(local, make_optimizer(local, lr, weight_decay), loss_comm=None)
        self.pp_comm = pp_comm
        self.stages = [PipelineStage(chunk, chunk.vstage, p * virtual, device, group=pp_comm.group)
                       for chunk in self.chunks]
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        self.global_tokens = 0  # set each step, read by the loss function
        self.counter = ((lambda: PipelineP2PCounter(log, [pp_comm], "pipelining", device.type == "cuda"))
                        if log is not None else contextlib.nullcontext)

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return token_loss_sum(logits, targets) / self.global_tokens

        cls = torch_schedule_class(schedule)
        # torch's single-stage classes (GPipe, 1F1B) take the one stage; the others a list, even of one.
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        self.schedule = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)

    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        """Torch splits the local batch back into the same microbatches (equal chunks along dim 0)."""
        self.phases("other", "zero_grad")
        self.zero_grad()
        self.global_tokens = global_tokens
        inputs = torch.cat([mb.inputs for mb in microbatches])
        targets = torch.cat([mb.targets for mb in microbatches])
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        # forward_context (autocast for bf16) covers torch's whole schedule: its forwards and
        # backwards are interleaved inside step().
        self.phases("compute", "torch schedule step")
        with self.counter(), self.forward_context():
            self.schedule.step(*args, return_outputs=False, **kwargs)
        self.phases("other", "finite check")
        local_loss = (torch.stack([loss.detach() for loss in losses]).sum() if losses
                      else torch.zeros((), device=inputs.device))
        self.guard_finite(local_loss)
        self.phases("optimizer", "optimizer step")
        self.optimizer.step()
        return local_loss

    def global_loss(self, local_loss: torch.Tensor) -> float:
        """Only the last stage holds the loss: sum over pp (the others add 0)."""
        self.pp_comm.all_reduce(local_loss, tag="tooling/loss")
        return float(local_loss)

    def full_parameter_count(self) -> int:
        return self._full_parameters

    def _gather(self, local: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for part in self.pp_comm.gather_object(local, 0, tag=tag) or []:
            merged.update(part)
        return merged

    def named_full_parameters(self):
        """This rank's chunks' parameters under their single-process names (a checkpoint's keys)."""
        return [(c.global_name(n), p) for c in self.chunks for n, p in c.named_parameters()]

    def full_optimizer_state(self) -> dict:
        """Each stage's moments under single-process names, merged on pp rank 0."""
        local = self.optimizer.named_state(self.named_full_parameters())
        return {"step": local["step"], "state": self._gather(local["state"], "tooling/optim_state")}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather({c.global_name(n): t.detach().cpu().clone()
                             for c in self.chunks for n, t in c.state_dict().items()},
                            "tooling/state")

    def full_grads(self) -> dict:
        return {"grads": self._gather({c.global_name(n): p.grad.detach().cpu().clone()
                                       for c in self.chunks for n, p in c.named_parameters()}, "tooling/grads"),
                "tp_replica_max_diff": {}}
