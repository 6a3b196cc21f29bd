"""Zero-bubble schedules: the backward split into B and W, and W moved into the bubbles.

B (the gradient with respect to a chunk's input) is what the previous stage waits for; W (the
gradient with respect to the chunk's weights) is wanted by nobody until the optimizer step. So a
schedule can run B as early as possible and keep W back to fill time a rank would otherwise spend
waiting (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241). The price is
memory: what W needs (the layer inputs) stays held from F until W, not until B.

Three schedules, each a pure function (stages, microbatches, virtual) -> actions per rank like
those in schedules.py, each with its bubble in closed form beside it (`*_idle`: the idle time each
chain of dependent actions forces; docs/theory/pipeline.md derives them).

* zbh1      ZB-H1 (Qi §3.1): 1F1B's warm-up and steady state, but rank r runs each W r steps
            after its B; the W held back fill the cool-down. Every rank holds at most p
            microbatches (1F1B's peak, that of its first rank).
* zbv       ZB-V (Qi §6): two chunks per rank on the V placement (placement.py), each a whole
            forward and backward, and W held back only in the cool-down. The order is PyTorch's
            ScheduleZBVZeroBubble (torch.distributed.pipelining, 2.13), itself the paper's.
* dualpipev DualPipeV (DeepSeek-V3 report §3.2.1; deepseek-ai/DualPipe `DualPipeV`): the V
            placement again; a rank's two chunks carry microbatches in opposite directions (chunk
            0 down the ranks, chunk 1 back up), and in the steady state each forward of one chunk
            is paired with the whole backward of the other (DeepSeek overlaps the pair; here they
            run one after the other). The order is PyTorch's ScheduleDualPipeV, DeepSeek's steps.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from parallel.pp.actions import Action, B, F, ScheduleError, W, check_sizes, in_send_order, with_comm
from parallel.pp.placement import LOOP, Placement, V


class _RankOrder:
    """One rank's compute order, built step by step: each F and B takes its chunk's next
    microbatch, and each split B leaves its W pending until `w` places it."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next = Counter()
        self.pending: list[Action] = []  # W whose B has run, oldest first

    def f(self, chunk: int) -> None:
        self.actions.append(Action(F, self.next[F, chunk], chunk))
        self.next[F, chunk] += 1

    def b(self, chunk: int, split: bool = True) -> None:
        """B of the chunk's next microbatch; without `split` its W follows at once (the whole backward)."""
        mb = self.next[B, chunk]
        self.next[B, chunk] += 1
        self.actions.append(Action(B, mb, chunk))
        (self.pending if split else self.actions).append(Action(W, mb, chunk))

    def w(self, chunk: int | None = None) -> None:
        """The oldest pending W (of `chunk`, if given); nothing if none is pending."""
        for i, a in enumerate(self.pending):
            if chunk is None or a.chunk == chunk:
                self.actions.append(self.pending.pop(i))
                return


def check_zb_h1(stages: int, microbatches: int, virtual: int) -> None:
    check_sizes(stages, microbatches, virtual)
    if virtual != 1:
        raise ScheduleError(f"parallel.virtual_stages={virtual}: zbh1 runs one chunk per rank; "
                            "use parallel.virtual_stages=1 (or the V schedules zbv and dualpipev for two chunks)")


def zb_h1(stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023 §3.1, Figure 3 top).

    Rank r runs 1F1B's min(p-r-1, m) warm-up forwards, then F and B alternately, then the
    remaining B; each W comes r B's after its own B (W_k right after B_{k+r}), and the last r
    follow the last B. Rank r thus holds at most p microbatches (F done, W not yet): 1F1B's peak.
    The W held back fill the time a rank waits in 1F1B's cool-down: idle (p-1)(F+B-W) instead of
    (p-1)(F+B+W) (for m >= p and W no longer than F or B; zb_h1_idle has every case).
    """
    check_zb_h1(stages, microbatches, virtual)
    p, m = stages, microbatches
    plans = []
    for r in range(p):
        order = _RankOrder()
        warmup = min(p - r - 1, m)
        for _ in range(warmup):
            order.f(0)
        for k in range(m):
            if k < m - warmup:
                order.f(0)
            order.b(0)
            if k >= r:
                order.w()
        while order.pending:
            order.w()
        plans.append(with_comm(order.actions, r, Placement(p, 1, LOOP)))
    return plans


def zb_h1_idle(stages: int, microbatches: int, virtual: int, time_f, time_b, time_w) -> list:
    """(p-1)(F+B) - (k-1)W, (p-1)F + (p-k)B, (p-1)B + (p-k)F with k = min(m, p); their max is
    Qi et al. 2023 §3.1's (p-1)(F + B - W) when m >= p, W <= F, W <= B."""
    p, m = stages, microbatches
    k = min(m, p)
    f, b, w = time_f, time_b, time_w
    return [(p - 1) * (f + b) - (k - 1) * w, (p - 1) * f + (p - k) * b, (p - 1) * b + (p - k) * f]


def _check_v(name: str, stages: int, microbatches: int, virtual: int) -> None:
    check_sizes(stages, microbatches, virtual)
    if virtual != 2:
        raise ScheduleError(f"parallel.virtual_stages={virtual}: {name} runs exactly two chunks per rank in a V; "
                            "set parallel.virtual_stages=2")


def check_zb_v(stages: int, microbatches: int, virtual: int) -> None:
    _check_v("zbv", stages, microbatches, virtual)


def check_dualpipe_v(stages: int, microbatches: int, virtual: int) -> None:
    _check_v("dualpipev", stages, microbatches, virtual)
    if microbatches < 2 * stages:
        raise ScheduleError(f"parallel.microbatches={microbatches}: dualpipev needs at least 2 x parallel.pp = "
                            f"{2 * stages} microbatches (its steady state starts after 2p forwards): "
                            f"use parallel.microbatches={2 * stages}")


def zb_v(stages: int, microbatches: int, virtual: int = 2) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023 §6), in PyTorch's ScheduleZBVZeroBubble order.

    Chunk 0 of rank r is virtual stage r, chunk 1 is 2p-1-r. Rank r runs
      warm-up    2(p-r)-1 forwards of chunk 0; r times (F chunk 1, F chunk 0);
                 p-r times (F, B, W of chunk 1)
      steady     F, B, W of chunk 0 then F, B, W of chunk 1, until chunk 0's forwards are done
      cool-down  r times (B chunk 0, B chunk 1); p-r times (B, W of chunk 0); the W left:
                 chunk 1's, then chunk 0's.
    The order is built for n = max(m, 2p-1) microbatches and those >= m are dropped: a rank's order
    restricted to fewer microbatches keeps every dependency, so it still runs, with a larger bubble.
    """
    check_zb_v(stages, microbatches, virtual)
    placement = Placement(stages, 2, V)
    p, m = stages, microbatches
    n = max(m, 2 * p - 1)
    plans = []
    for r in range(p):
        o = _RankOrder()
        for _ in range(2 * (p - r) - 1):
            o.f(0)
        for _ in range(r):
            o.f(1)
            o.f(0)
        for _ in range(p - r):
            o.f(1)
            o.b(1, split=False)
        while o.next[F, 1] < o.next[F, 0] or o.next[F, 0] < n:
            if o.next[F, 0] < n:
                o.f(0)
            o.b(0, split=False)
            o.f(1)
            o.b(1, split=False)
        for _ in range(r):
            o.b(0)
            o.b(1)
        for _ in range(p - r):
            o.b(0)
            o.w(0)
        while any(a.chunk == 1 for a in o.pending):
            o.w(1)
        while o.pending:
            o.w(0)
        plans.append(with_comm([a for a in o.actions if a.mb < m], r, placement))
    return in_send_order(plans, placement)


def zb_v_in_flight(stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """The first rank's 2p-1 warm-up forwards of chunk 0 (every one, where m is fewer) and the first
    forward of chunk 1, before the first backward frees one."""
    return min(microbatches, 2 * stages - 1), 1


def zb_v_idle(stages: int, microbatches: int, virtual: int, time_f, time_b, time_w) -> list | None:
    """Eight chains in chunk times f, b, w = F/2, B/2, W/2 (docs/theory/pipeline.md names each);
    p = 1: 0. ZB-V's order changes shape below m = 2p - 1 (it is built for 2p - 1 and cut down):
    there no closed form is claimed (None) and the simulator gives the bubble."""
    p, m = stages, microbatches
    if m < 2 * p - 1:
        return None
    if p == 1:
        return [0 * time_f]  # both chunks on one rank: nothing to wait for
    f, b, w = Fraction(time_f) / 2, Fraction(time_b) / 2, Fraction(time_w) / 2
    return [(p - 1) * b, b + (p - 2) * w, f + (p - 2) * w, (2 * p - 3) * f - (p - 2) * b,
            2 * (p - 1) * (b - w), 2 * (p - 1) * f - (p - 1) * b - w, 2 * (p - 1) * f - (2 * p - 1) * w,
            (2 * p - 3) * f + b - 2 * (p - 1) * w]


def dualpipe_v(stages: int, microbatches: int, virtual: int = 2) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3 report §3.2.1 folded onto p ranks), in PyTorch's ScheduleDualPipeV
    order, DeepSeek's eight steps. "F0 & B1" is a forward of chunk 0 paired with the whole backward
    (B then W) of chunk 1, run one after the other. Rank r runs

      1  2(p-r-1) times F0                       5  p-r-1 times B1 (whole), then F1 & B0
      2  r+1 times F0, F1                        6  r+1 times B1, B0: whole backwards for the
      3  p-r-1 times B1 (split), a pending W, F1    first half, split ones after
      4  m-2p+r+1 times F0 & B1, then F1 & B0    7  p-r-1 times a pending W, then B0
                                                 8  the r+1 pending W

    where a split B leaves its W pending and a pending W is the oldest one. Step 4 needs m >= 2p.
    """
    check_dualpipe_v(stages, microbatches, virtual)
    placement = Placement(stages, 2, V)
    p, m = stages, microbatches
    plans = []
    for r in range(p):
        o = _RankOrder()
        for _ in range(2 * (p - r - 1)):                  # 1: chunk 0 forwards fill the V's first arm
            o.f(0)
        for _ in range(r + 1):                            # 2: forwards of both chunks
            o.f(0)
            o.f(1)
        for _ in range(p - r - 1):                        # 3: zero-bubble backwards of chunk 1
            o.b(1)
            o.w()
            o.f(1)
        for _ in range(m - 2 * p + r + 1):                # 4: the steady state, F of one chunk & B of the other
            o.f(0)
            o.b(1, split=False)
            o.f(1)
            o.b(0, split=False)
        for _ in range(p - r - 1):                        # 5: chunk 0's forwards are done
            o.b(1, split=False)
            o.f(1)
            o.b(0, split=False)
        split = False
        for i in range(r + 1):                            # 6: backwards only; W deferred from the middle on
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            o.b(1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            o.b(0, split)
        for _ in range(p - r - 1):                        # 7
            o.w()
            o.b(0, split)
        for _ in range(r + 1):                            # 8: the W left
            o.w()
        plans.append(with_comm(o.actions, r, placement))
    return in_send_order(plans, placement)


def dualpipe_v_in_flight(stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """The first rank's steps 1 and 2 leave 2p-1 forwards of chunk 0 and one of chunk 1 held, each of
    step 3's W frees what its B's chunk held before the next forward of that chunk, and step 4's first
    forward adds one of chunk 0 before its first backward frees one (m >= 2p)."""
    return 2 * stages, 1


def dualpipe_v_idle(stages: int, microbatches: int, virtual: int, time_f, time_b, time_w) -> list:
    """Seven chains in chunk times f, b, w = F/2, B/2, W/2 (docs/theory/pipeline.md names each),
    for every m it accepts (m >= 2p); p = 1: 0."""
    p = stages
    if p == 1:
        return [0 * time_f]
    f, b, w = Fraction(time_f) / 2, Fraction(time_b) / 2, Fraction(time_w) / 2
    return [(p - 1) * f, 2 * (p - 1) * b - (p - 1) * w - f, (p - 1) * (f + b - w), (p - 1) * b - f,
            2 * (p - 1) * f - (p - 1) * (b + w), 2 * (p - 1) * f - (2 * p - 1) * w, (2 * p - 3) * (f - w) + b]
