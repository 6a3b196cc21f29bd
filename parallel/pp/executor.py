"""Run a pipeline schedule for real: the same action lists the simulator checks.

Each rank walks its list. Forward and backward run its chunks; in a schedule that splits the
backward (zero_bubble.py), B computes only the chunk's input gradient and W, later, its weight
gradients (split_backward.py). Its sends and receives are made as its posting plan says
(posting.py), the very records progress.py proves finish under the backend's rules: which ops are
posted together (one batch_isend_irecv through the communication log), on which group, and where
the rank waits for them. A receive is waited for right before the compute that needs it and the
sends at the end of the step, whatever the posting; what changes is where a receive is posted:

* gloo (the default on gloo): every receive of the step at its start, in the list's order (each
  peer's send order, actions.py), on the pipeline group; each run of sends where it stands. A send
  finds its receive already posted and its message moves on gloo's threads while this rank computes.
* nccl (the default on NCCL): every receive at the step's start too, but each on its own link, the
  2-rank group of one direction of one neighbour pair (made by parallel/dist/groups.py
  `link_groups`), and each send on its link where it stands. On NCCL the groups posted on one
  communicator run one after the other and a send waits for its receive to be running, so one
  group for the whole pipeline deadlocks some schedules (progress.py shows the cycle); with a
  link per direction nothing queues behind anything but its own direction's messages. It runs on
  gloo too (parallel.pp_posting=nccl), which is how the CPU tests reach it.

Every link's Communicator logs under "pp", the pipeline group's name, so the bytes per group are
what they were. (bench/pp_action_overhead.py measures the walk's own cost per action beside the
chunk's compute.) The list itself, what the simulator and the timeline read, is unchanged: the
timeline's spans are stamped by the step's clock (CUDA events on a GPU, the wall clock on the
CPU), and `executed` reaches a send where it is posted and a receive where it is waited for.
Activations cross stage boundaries as (microbatch, seq, d_model) fp32 tensors (under bf16
autocast too: a chunk ends with a block or the embedding, whose residual stream stays fp32).

Which rank holds which virtual stage is the schedule's placement (placement.py): the loop, or the
V, where rank r holds stages r and 2p-1-r. A boundary inside one rank (the V's turn) sends
nothing: the next chunk takes the output, and backward the input gradient, from the rank itself.

The loss exists only on the last virtual stage: each microbatch's summed token loss divided by
the global batch's token count, so the gradients equal the single-process ones (dividing by the
microbatch's own count would make them m times too large, the classic mistake). The global mean
loss reaches rank 0 through an all-reduce over pp and then dp, tagged as tooling.

The runner is given its parts rather than building them: the chunks this rank holds, the
optimizer, the gradient sync over dp, how the last stage turns its output into a loss, what
crosses a boundary, and how its parameters are cut over tp (`shards`: tensor parallelism's `TPShards`,
which is the identity without tp; the pipeline only calls its gather, local_part and replica_spread).
parallel/compose/combined.py composes them for `pp` and for dp x tp x pp.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from parallel.core.data import Batch
from parallel.core.model import token_loss_sum
from parallel.dist.comm import Communicator, Handle
from parallel.pp.actions import RECV_F, SEND_B, SEND_F, Action, B, F, W, splits_backward
from parallel.pp.posting import RECEIVES, SENDS, Link, Post, Wait, channels, posting_plan
from parallel.pp.schedules import build_schedule, schedule_placement
from parallel.pp.split import PipelineChunk
from parallel.pp.split_backward import SplitBackward
from parallel.strategy import GradSync, ParameterCut, Strategy, flat_moments, moment_param, nest_moments

KIND = {F: "forward", B: "backward", W: "weight"}  # a compute action's kind in the timeline


class PipelineParallel(Strategy):
    name = "pp"

    def __init__(self, chunks: list[PipelineChunk], *, pp_comm: Communicator, dp_comm: Communicator | None,
                 schedule: str, microbatches: int, virtual: int, optimizer, sync: GradSync, full_parameters: int,
                 d_model: int, stage_loss=token_loss_sum, boundary_seq_parts: int = 1, shards: ParameterCut,
                 tp_comm: Communicator | None = None, posting: str = "gloo",
                 links: dict[Link, Communicator] | None = None):
        self._full_parameters = full_parameters
        self.stages = pp_comm.size
        self.pp_rank = pp_comm.rank
        self.virtual = virtual
        self.last_vstage = self.stages * virtual - 1
        self.chunks = chunks
        super().__init__(nn.ModuleList(chunks), optimizer, loss_comm=dp_comm, sync=sync)
        self.pp_comm, self.dp_comm, self.tp_comm = pp_comm, dp_comm, tp_comm
        self.d_model = d_model
        self.stage_loss = stage_loss  # (last chunk's output, targets) -> summed token loss
        self.boundary_seq_parts = boundary_seq_parts  # each rank sends 1/this of the sequence (sequence parallelism)
        self.shards = shards
        self.schedule = schedule
        self.microbatches = microbatches
        plans = build_schedule(schedule, self.stages, microbatches, virtual)
        self.actions: list[Action] = plans[self.pp_rank]
        self.placement = schedule_placement(schedule, self.stages, virtual)
        # Whether B is only the input gradient and W the weights' (then the gradient sync's
        # microbatch moments are around W, the action that accumulates into .grad).
        self.split = splits_backward(plans)
        # The walk, computed once: the list with its sends and receives as the posting posts them.
        self.posting, self.plan = posting, posting_plan(posting, self.actions, self.pp_rank, self.placement)
        self.links = links or {}  # the link groups the nccl posting posts on (parallel/dist/groups.py)
        missing = channels(self.plan) - set(self.links)
        if missing:
            raise ValueError(f"the {posting} posting posts on links {sorted(map(str, missing))}, whose groups "
                             "were not given")
        self.executed: list[Action] = []  # the order actually run in the last step (tests compare it with the schedule)
        self._spans: list[dict] = []  # the last step's timeline: one record per action (see `spans`)
        self._origin = None  # on a GPU: the last step's origin event and its wall time
        self._device_clock = None  # on a GPU: the step's clock, whose events stamp the spans

    def full_parameter_count(self) -> int:
        return self._full_parameters

    def named_full_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (tp pieces, if cut) under their single-process names."""
        return global_named_parameters(self.chunks)

    def _activation_shape(self, mb: Batch) -> tuple[int, ...]:
        """What crosses a stage boundary: one microbatch's hidden states (or this tp rank's piece
        of its sequence, under sequence parallelism)."""
        return (mb.n_sequences, mb.inputs.shape[1] // self.boundary_seq_parts, self.d_model)

    # -- helpers ----------------------------------------------------------------------------------
    def _vstage(self, a: Action) -> int:
        return self.placement.vstage(self.pp_rank, a.chunk)

    def _peer(self, vstage: int) -> int:
        return self.placement.rank_of(vstage)  # the pp-group rank that holds a virtual stage

    def _local_chunk(self, vstage: int) -> int | None:
        """This rank's chunk for a neighbouring virtual stage it holds itself (the V's turn), else None."""
        if not 0 <= vstage <= self.last_vstage:
            return None
        rank, chunk = self.placement.location(vstage)
        return chunk if rank == self.pp_rank else None

    def _span(self, name: str, kind: str, a: Action | None, start, end) -> None:
        self._spans.append({"name": name, "kind": kind, "mb": a.mb if a else -1, "chunk": a.chunk if a else -1,
                            "start": start, "end": end})

    def _now(self):
        """A stamp of the step's clock: on a GPU a CUDA event on the stream that runs the work (so a
        span lasts as long as the device spent on it); on the CPU the wall clock."""
        return self._device_clock.now() if self._device_clock is not None else time.time()

    @property
    def spans(self) -> list[dict]:
        """The last step's timeline, one record per compute, post and wait, in seconds on the wall
        axis (pp/timeline.py puts the ranks of a machine side by side on it). On a GPU the stamps are
        events, read once here: seconds from the step's origin event, plus the origin's wall time."""
        if self._origin is None:
            return self._spans
        origin, wall = self._origin

        def at(event) -> float:
            event.synchronize()
            return wall + origin.elapsed_time(event) / 1e3  # elapsed_time is in ms

        return [{**s, "start": at(s["start"]), "end": at(s["end"])} for s in self._spans]

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        self.phases("other", "zero_grad")
        self.zero_grad()
        self._start_clock()
        self.executed, self._spans = [], []
        device = microbatches[0].inputs.device
        act_shape = self._activation_shape(microbatches[0])
        inputs: dict[tuple[int, int], torch.Tensor] = {}    # received activations (leaves with grad)
        outputs: dict[tuple[int, int], torch.Tensor] = {}   # chunk outputs, or the loss on the last stage
        out_grads: dict[tuple[int, int], torch.Tensor] = {}  # received gradients of the outputs
        pending: dict[tuple[int, int], SplitBackward] = {}  # B done, W not yet
        handles: dict[Action, Handle] = {}                  # each posted send and receive's work
        local_loss = torch.zeros((), device=device)
        for a in self.plan:
            if isinstance(a, Post):
                self._post(a, handles, inputs, outputs, out_grads, act_shape, device)
                continue
            if isinstance(a, Wait):
                self._wait(a, handles, inputs)
                continue
            self.phases(KIND[a.op], str(a))  # forward, backward, or weight (W, a split backward's second half)
            start = self._now()
            if a.op == F:
                self._forward(a, microbatches[a.mb], global_tokens, inputs, outputs, local_loss)
            elif a.op == B:
                self._backward(a, inputs, outputs, out_grads, pending)
            else:  # W
                with self.microbatch_context(last_microbatch=a.mb == self.microbatches - 1):
                    pending.pop((a.mb, a.chunk)).weight_grad()
            self._span(str(a), KIND[a.op], a, start, self._now())
            self.executed.append(a)
        self.phases("sync", "gradient sync")
        self.after_backward()
        self.phases("other", "finite check")
        self.guard_finite(local_loss)  # only the last stage has a loss; the flag reaches every stage
        self.phases("optimizer", "optimizer step")
        self.optimizer.step()
        return local_loss

    def _start_clock(self) -> None:
        """On a GPU the spans are stamped by the step's clock (the training loop's, parallel/dist/timing.py),
        read against its origin; without one (a bench, a test) and on the CPU, by the wall clock."""
        clock = self.pp_comm.log.clock
        cuda = clock is not None and clock.cuda and clock.origin is not None
        self._device_clock = clock if cuda else None
        self._origin = (clock.origin, clock.origin_wall) if cuda else None

    def _forward(self, a: Action, microbatch: Batch, global_tokens: int, inputs, outputs,
                 local_loss: torch.Tensor) -> None:
        """Run the chunk on its input; the last stage turns the output into its share of the loss."""
        key, vs = (a.mb, a.chunk), self._vstage(a)
        x = microbatch.inputs if vs == 0 else inputs[key]
        with self.forward_context():
            out = self.chunks[a.chunk](x)
            if vs == self.last_vstage:
                out = self.stage_loss(out, microbatch.targets) / global_tokens
        if vs == self.last_vstage:
            local_loss += out.detach()
        outputs[key] = out
        following = self._local_chunk(vs + 1)
        if following is not None:  # the next stage is this rank's own: hand the output over
            inputs[(a.mb, following)] = out.detach().requires_grad_(True)

    def _backward(self, a: Action, inputs, outputs, out_grads, pending: dict) -> None:
        """The whole backward, or (split) the input gradient only, leaving W its half in `pending`."""
        key, vs = (a.mb, a.chunk), self._vstage(a)
        out, x = outputs.pop(key), inputs.get(key)
        grad = None if vs == self.last_vstage else out_grads.pop(key)
        # A split backward's B brings weights' gradients too where a recomputed block backpropagates whole.
        with self.microbatch_context(last_microbatch=a.mb == self.microbatches - 1):
            if self.split:  # the input gradient only; W runs the rest later
                pending[key] = SplitBackward(out, grad, x, list(self.chunks[a.chunk].parameters()))
                pending[key].input_grad()
            else:
                torch.autograd.backward(out, grad)
        previous = self._local_chunk(vs - 1)
        if previous is not None:  # the previous stage is this rank's own: hand the gradient back
            out_grads[(a.mb, previous)] = inputs.pop(key).grad

    def _op(self, a: Action, inputs, outputs, out_grads, act_shape, device) -> tuple:
        """A send's tensor, or a receive's buffer placed where its compute will look for it, as an op
        for `Communicator.batch_p2p` (peer: a pipeline rank)."""
        key, vs = (a.mb, a.chunk), self._vstage(a)
        if a.op == SEND_F:
            return ("send", outputs[key].detach(), self._peer(vs + 1), f"pp/fwd/{vs}->{vs + 1}")
        if a.op == SEND_B:
            return ("send", inputs.pop(key).grad, self._peer(vs - 1), f"pp/bwd/{vs}->{vs - 1}")
        buf = torch.empty(act_shape, device=device)
        if a.op == RECV_F:
            inputs[key] = buf
            return ("recv", buf, self._peer(vs - 1), f"pp/fwd/{vs - 1}->{vs}")
        out_grads[key] = buf
        return ("recv", buf, self._peer(vs + 1), f"pp/bwd/{vs + 1}->{vs}")

    def _post(self, step: Post, handles: dict, *buffers) -> None:
        """One batch_isend_irecv on the step's group; each action's handle (a coalesced batch's one work
        stands for all its ops). A send is reached here, in the list's order."""
        comm = self.pp_comm if step.channel is None else self.links[step.channel]
        ops = [self._op(a, *buffers) for a in step.actions]
        ops = [(kind, tensor, comm.global_ranks.index(self.pp_comm.global_ranks[peer]), tag)
               for kind, tensor, peer, tag in ops]
        name = f"post {step.label or ' '.join(map(str, step.actions))}"
        self.phases("p2p", name)
        start = self._now()
        posted = comm.batch_p2p(ops)
        self._span(name, "p2p", None if step.label else step.actions[0], start, self._now())
        one_each = len(posted) == len(ops)
        handles.update({a: posted[k if one_each else 0] for k, a in enumerate(step.actions)})
        self.executed += [a for a in step.actions if a.op in SENDS]

    def _wait(self, step: Wait, handles: dict, inputs) -> None:
        """Wait for the step's sends or receives (each work once). A receive is reached here."""
        name = f"wait {step.label or ' '.join(map(str, step.actions))}"
        self.phases("p2p", name)
        start = self._now()
        for handle in dict.fromkeys(handles[a] for a in step.actions):
            handle.wait()
        for a in step.actions:
            if a.op == RECV_F:
                inputs[(a.mb, a.chunk)].requires_grad_(True)
        self._span(name, "wait", None if step.label else step.actions[0], start, self._now())
        self.executed += [a for a in step.actions if a.op in RECEIVES]

    # -- results ----------------------------------------------------------------------------------
    def global_loss(self, local_loss: torch.Tensor) -> float:
        """Only the last stage holds the loss: sum over pp (others add 0), then over dp."""
        if self.stages > 1:
            self.pp_comm.all_reduce(local_loss, tag="tooling/loss")
        return super().global_loss(local_loss)

    def _gather_to_first_stage(self, local: dict, tag: str) -> dict:
        """Every stage's entries, already under single-process names, merged on pp rank 0."""
        merged = {}
        for part in self.pp_comm.gather_object(local, 0, tag=tag) or []:
            merged.update(part)
        return merged

    # Whole-model views (collective; valid on rank 0): this rank's pieces gathered over tp, then
    # every stage's merged on the first stage. The optimizer may be AdamW or a ZeroOptimizer over
    # dp: both give their moments by parameter name (the latter gathered over dp first).
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather_to_first_stage(self.shards.gather(dict(self.named_full_parameters())), "tooling/state")

    def full_optimizer_state(self) -> dict:
        local = self.optimizer.named_state(self.named_full_parameters())
        whole = self.shards.gather(flat_moments(local["state"]), moment_param)
        return {"step": local["step"], "state": nest_moments(self._gather_to_first_stage(whole, "tooling/optim_state"))}

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return self.shards.local_part(name, full).contiguous()

    def full_grads(self) -> dict:
        grads = self.synced_local_grads()
        spread = self.shards.replica_spread(grads)
        return {"grads": self._gather_to_first_stage(self.shards.gather(grads), "tooling/grads"),
                "tp_replica_max_diff": self._gather_to_first_stage(spread, "tooling/grads")}

    def synced_local_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients as the optimizer used them, by name; under ZeRO only the dp shards
        hold the synced sums, so they are gathered over dp (collective)."""
        synced = self.sync.synced_grads()
        return synced if synced is not None else {n: p.grad for n, p in self.named_full_parameters()}

    def memory_report(self) -> dict:
        return self.sync.memory() or super().memory_report()

    def close(self) -> None:
        for comm in (self.pp_comm, self.dp_comm, self.tp_comm, *self.links.values()):
            if comm is not None:
                comm.wait_all()


def global_named_parameters(chunks: list[PipelineChunk]) -> list[tuple[str, nn.Parameter]]:
    """The chunks' parameters under their single-process names."""
    return [(chunk.global_name(n), p) for chunk in chunks for n, p in chunk.named_parameters()]
