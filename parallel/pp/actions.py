"""The vocabulary of pipeline schedules: actions, and the sends and receives around them.

* p pipeline ranks, m microbatches, v model chunks per rank ("virtual stages"); which rank holds
  which virtual stage is the schedule's placement (placement.py).
* Actions, each about one microbatch `mb` on one local `chunk`:
    F        forward
    B        backward. In a schedule that splits the backward (zero_bubble.py) B is only the
             gradient with respect to the chunk's input, which the previous stage waits for; the
             gradient with respect to the weights is the separate action
    W        weight gradient: nobody waits for it, so a schedule may run it later to fill a bubble.
             Without W actions B is the whole backward.
    SEND_F   send the chunk's output activation to the next virtual stage
    RECV_F   receive the chunk's input activation from the previous virtual stage
    SEND_B   send the gradient of the chunk's input to the previous virtual stage
    RECV_B   receive the gradient of the chunk's output from the next virtual stage
  A RECV is placed right before the compute that consumes it and a SEND right after the compute
  that produces it. Under gloo's rules a send is posted without waiting (isend) and a receive waits
  until its message has arrived: a list of actions then deadlocks only if its compute order does,
  which the simulator rules out. Under NCCL's a send completes only once its receive is running,
  and the ops posted on one communicator run in order, so how the executor posts the sends and
  receives matters too: posting.py writes that down per backend, progress.py proves it finishes.
  A boundary inside one rank (the V placement's turn) has no send and no
  receive: the rank's next chunk takes the output directly, and that order is the rank's own.
* Messages between two ranks are matched in the order they were posted (gloo and NCCL alike; no
  tag tells two same-shaped activations apart), so each rank must post its receives from a peer
  in the order that peer sends. With one direction per pair of ranks (the loop) that holds by
  itself; on the V a rank both sends forward to and receives backward from each neighbour, and
  a rank may need a later message first. `in_send_order` then posts the earlier ones too, just
  before it (they are already on their way: waiting for them costs nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.pp.placement import Placement

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True, order=True)
class Action:
    op: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A (stages, microbatches, virtual) combination the schedule cannot run."""


def with_comm(compute: list[Action], rank: int, placement: Placement) -> list[Action]:
    """Insert each compute's receive before it and its send after it.

    The first virtual stage has no one to receive an input from (it reads the batch) and the last
    computes the loss itself, so those receives and sends are left out; so are those of a boundary
    inside the rank. W neither receives nor sends.
    """
    last = placement.vstages - 1
    out: list[Action] = []
    edges: dict[int, tuple[bool, bool]] = {}  # per chunk: a rank's lists hold m actions of each of its v chunks
    for a in compute:
        if a.chunk not in edges:
            vs = placement.vstage(rank, a.chunk)
            edges[a.chunk] = vs > 0 and placement.crosses(vs - 1), vs < last and placement.crosses(vs)
        gets_input, sends_output = edges[a.chunk]
        if a.op == F:
            if gets_input:
                out.append(Action(RECV_F, a.mb, a.chunk))
            out.append(a)
            if sends_output:
                out.append(Action(SEND_F, a.mb, a.chunk))
        elif a.op == B:
            if sends_output:
                out.append(Action(RECV_B, a.mb, a.chunk))
            out.append(a)
            if gets_input:
                out.append(Action(SEND_B, a.mb, a.chunk))
        else:
            out.append(a)
    return out


def message(rank: int, a: Action, placement: Placement) -> tuple[int, int, tuple[str, int, int]]:
    """A send's or receive's (sender, receiver, what): what = (direction, microbatch, receiving vstage)."""
    vs = placement.vstage(rank, a.chunk)
    if a.op == SEND_F:
        return rank, placement.rank_of(vs + 1), ("F", a.mb, vs + 1)
    if a.op == SEND_B:
        return rank, placement.rank_of(vs - 1), ("B", a.mb, vs - 1)
    if a.op == RECV_F:
        return placement.rank_of(vs - 1), rank, ("F", a.mb, vs)
    return placement.rank_of(vs + 1), rank, ("B", a.mb, vs)  # RECV_B


def in_send_order(plans: list[list[Action]], placement: Placement) -> list[list[Action]]:
    """Each rank's receives from a peer, reordered to that peer's send order: where a rank first
    needs a message that its peer sends after others it has not received yet, the receives of
    those others are posted just before (in the same run of sends and receives)."""
    sent = {}  # (sender, receiver) -> what, in the sender's order
    for rank, actions in enumerate(plans):
        for a in actions:
            if a.op in (SEND_F, SEND_B):
                src, dst, what = message(rank, a, placement)
                sent.setdefault((src, dst), []).append(what)
    receive_of = {}  # what -> the receiving action
    for rank, actions in enumerate(plans):
        for a in actions:
            if a.op in (RECV_F, RECV_B):
                receive_of[message(rank, a, placement)[2]] = a
    out = []
    for rank, actions in enumerate(plans):
        posted, done = {}, set()  # peer -> receives posted from it; what has been received
        ordered = []
        for a in actions:
            if a.op not in (RECV_F, RECV_B):
                ordered.append(a)
                continue
            src, _, what = message(rank, a, placement)
            if what in done:
                continue  # posted early, with a later message
            queue = sent[src, rank]
            while what not in done:
                earlier = queue[posted.get(src, 0)]
                posted[src] = posted.get(src, 0) + 1
                done.add(earlier)
                ordered.append(receive_of[earlier])
        out.append(ordered)
    return out


def check_sizes(stages: int, microbatches: int, virtual: int) -> None:
    for name, value in (("parallel.pp", stages), ("parallel.microbatches", microbatches),
                        ("parallel.virtual_stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r} must be a positive integer")


def compute_only(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.op in COMPUTE]


def splits_backward(plans: list[list[Action]]) -> bool:
    """Whether the schedule runs W apart from B (then activations are held until W, not B)."""
    return any(a.op == W for actions in plans for a in actions)
