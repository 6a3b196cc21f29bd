"""How the executor posts a rank's sends and receives: the posting plan, as data.

The action lists (schedules.py) say what a rank computes and which messages it sends and receives,
in order. They do not say how the messages are handed to the backend, and that matters: NCCL and
gloo run the same calls under different rules (progress.py plays a plan under either). A rank's
posting plan is its list with every send and receive turned into the calls the executor makes for
it, in the order it makes them:

    Post(channel, actions)  one batch_isend_irecv of these sends and receives (one NCCL group), on
                            `channel`: None, the pipeline's group of all p ranks, or a Link(src, dst),
                            a group of two ranks that carries only src's messages to dst
    Wait(actions)           wait until these sends or receives have completed
    F, B, W                 the compute itself (the Action)

The executor walks this plan and nothing else (executor.py), and progress.py plays the very same
records under each backend's rules, so what is proven is what runs. Three postings:

    gloo   every receive of the step in one Post on the pipeline group at the step's start, in the
           list's order; each run of consecutive sends one Post where it stands. A send then finds its
           receive already posted, and its bytes move on gloo's threads while the receiver computes.
    nccl   every receive of the step posted at the step's start, each its own Post on its link, in
           the list's order; each send its own Post on its link where it stands. On a link one rank
           only sends and the other only receives, in the same order (in_send_order, actions.py), so
           the k-th receive is running once the k-1 before it have completed, and those needed
           nothing but the sender's earlier sends: a send never waits for anything but its own
           link, and NCCL's rules add no wait that gloo's do not have.
    runs   the posting the executor first used on GPUs, kept to show why it was replaced: each run of
           consecutive sends and receives one Post on the pipeline group where it stands, its
           receives waited for right after (that executor also waited at once for a run of several
           sends and no receive, which no shipped schedule has). On NCCL one group runs after the
           previous one on the same communicator, so a rank's receive can sit behind its own send,
           whose match the peer posts only after a group that needs that very receive (progress.py
           finds the cycle).

In all three a receive is waited for at its place in the list (before the compute that needs it)
and the sends at the step's end. A Post or Wait that stands for the whole step has a `label`
("receives", "sends"), which the timeline shows instead of every action's name.
"""

from __future__ import annotations

from typing import NamedTuple

from parallel.pp.actions import COMM, RECV_B, RECV_F, SEND_B, SEND_F, Action, message
from parallel.pp.placement import Placement

SENDS, RECEIVES = (SEND_F, SEND_B), (RECV_F, RECV_B)


class Link(NamedTuple):
    """The group of two pipeline ranks that carries src's messages to dst, and nothing else."""

    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


# Named tuples rather than frozen dataclasses: the run validator builds a plan of every rank for each
# schedule, size and posting it checks, and these are made by the thousand.
class Post(NamedTuple):
    channel: Link | None  # None: the pipeline's group
    actions: tuple[Action, ...]
    label: str = ""


class Wait(NamedTuple):
    actions: tuple[Action, ...]
    label: str = ""


Step = Post | Wait | Action


def runs_of(actions: list[Action]) -> list:
    """The list as runs: each compute action alone, each run of consecutive sends and receives as
    one tuple."""
    walk, run = [], []
    for a in actions:
        if a.op in COMM:
            run.append(a)
            continue
        if run:
            walk.append(tuple(run))
            run = []
        walk.append(a)
    if run:
        walk.append(tuple(run))
    return walk


def _of(actions, ops) -> tuple[Action, ...]:
    return tuple(a for a in actions if a.op in ops)


def _end(actions: list[Action]) -> list[Step]:
    sends = _of(actions, SENDS)
    return [Wait(sends, "sends")] if sends else []


def gloo_posting(actions: list[Action], rank: int, placement: Placement) -> list[Step]:
    receives = _of(actions, RECEIVES)
    out: list[Step] = [Post(None, receives, "receives")] if receives else []
    for item in runs_of(actions):
        if not isinstance(item, tuple):
            out.append(item)
            continue
        if _of(item, SENDS):
            out.append(Post(None, _of(item, SENDS)))
        if _of(item, RECEIVES):
            out.append(Wait(_of(item, RECEIVES)))
    return out + _end(actions)


def link_of(rank: int, a: Action, placement: Placement) -> Link:
    src, dst, _ = message(rank, a, placement)
    return Link(src, dst)


def nccl_posting(actions: list[Action], rank: int, placement: Placement) -> list[Step]:
    out: list[Step] = [Post(link_of(rank, a, placement), (a,)) for a in _of(actions, RECEIVES)]
    for a in actions:
        if a.op in SENDS:
            out.append(Post(link_of(rank, a, placement), (a,)))
        elif a.op in RECEIVES:
            out.append(Wait((a,)))
        else:
            out.append(a)
    return out + _end(actions)


def runs_posting(actions: list[Action], rank: int, placement: Placement) -> list[Step]:
    out: list[Step] = []
    for item in runs_of(actions):
        if not isinstance(item, tuple):
            out.append(item)
            continue
        out.append(Post(None, item))
        if _of(item, RECEIVES):
            out.append(Wait(_of(item, RECEIVES)))
    return out + _end(actions)


POSTINGS = {"gloo": gloo_posting, "nccl": nccl_posting, "runs": runs_posting}
CHOICES = ("auto", "gloo", "nccl")  # parallel.pp_posting: auto is the backend's own


def posting_for(choice: str, backend: str | None) -> str:
    """The posting a run uses: parallel.pp_posting, or with `auto` its backend's (gloo's where there is
    no backend: one process sends nothing)."""
    if choice != "auto":
        return choice
    return "nccl" if backend == "nccl" else "gloo"


def posting_plan(posting: str, actions: list[Action], rank: int, placement: Placement) -> list[Step]:
    """One rank's posting plan for its action list."""
    if posting not in POSTINGS:
        raise ValueError(f"posting {posting!r}: choose one of {', '.join(POSTINGS)}")
    return POSTINGS[posting](actions, rank, placement)


def posting_plans(posting: str, plans: list[list[Action]], placement: Placement) -> list[list[Step]]:
    """Every rank's posting plan for its action list."""
    return [posting_plan(posting, actions, rank, placement) for rank, actions in enumerate(plans)]


def channels(steps: list[Step]) -> set[Link]:
    """The links a plan posts on."""
    return {s.channel for s in steps if isinstance(s, Post) and s.channel is not None}


def pipeline_links(placement: Placement) -> list[Link]:
    """Every link a pipeline's messages take: both directions of each boundary between two ranks,
    in one order every rank computes alike (the groups are made in it)."""
    links = set()
    for vs in range(placement.vstages - 1):
        if placement.crosses(vs):
            low, high = placement.rank_of(vs), placement.rank_of(vs + 1)
            links |= {Link(low, high), Link(high, low)}
    return sorted(links)
