"""A floor under a request's step time, read off the request before run_plan.py is asked about it.

The search ranks layouts by their predicted step (parallel/planner/timing.py): compute + exposed
communication + bubble. A floor under that sum lets it skip a request that cannot reach the rows
already found (parallel/planner/search.py asks the cheapest requests first and stops asking where
the floor passes the slowest row it keeps). Each term of the floor is one that timing.py's own
figure can only exceed, so skipping never drops a row that would have ranked among those kept:

compute   timing.py's compute is m x (F + B) of the slowest stage, F and B one microbatch's
          forward and backward on a rank, each linear in the blocks the rank holds (plus the head
          on the last rank). The slowest stage's F + B is at least any rank's, so at least the
          largest of the ranks' own figures (compute.py's roofline, or the FLOP count where the
          cluster has no roofline: there the slowest stage is the one with the slowest forward,
          and its backward is twice that forward or more). Sequence parallelism is taken where tp
          allows it: it only divides the elementwise kernels' bytes, so the floor never exceeds the
          row's own compute.
exposed   timing.py counts every tp collective as blocking compute (it sits between the GEMMs):
          per microbatch and block, tp_tensors_per_layer(recompute) tensors of b·s·h, each an
          all-reduce or an all-gather plus a reduce-scatter, 2(t-1)/t of its bytes sent per rank,
          over the mean rank's L/p blocks (the embedding, the head, the loss and the once-per-step
          gradients only add to it), at no more than the fastest link's rate x comm_efficiency
          and no latency; where the cluster overlaps backward's tp collectives (tp_backward_overlap),
          2 tensors fewer (timing.py hides at most the column-parallel linears' reductions, and the
          re-gathers this count leaves out). The rest of the communication is counted as 0.
bubble    the schedule's closed form (parallel/pp/schedules.py) is the longest of several chains,
          each a sum a·F' + c·B' over the costs timing.py plays it with (the other stages' mean F and
          B, the fill and drain running through them, with the blocking tp, cp and ep collectives
          added: at least the fastest rank's F + B). A chain whose coefficients are both >= 0 is at
          least min(a, c)·(F + B), so the idle is at least the largest such figure; a chain with a
          negative coefficient is left out (leaving a chain out of a max only lowers it), and so is
          the whole bubble where the schedule claims no closed form for these sizes (0). The
          coefficients are read from the formula at unit costs, taking for c the lower of the two
          ways a schedule may play its backward (whole, or split into B and W halves), so the floor
          holds without building the schedule.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from parallel.compose.theory import stage_layers
from parallel.core.shape import ModelShape
from parallel.cp.options import CP_KINDS
from parallel.dist.dims import ParallelDims
from parallel.planner.cluster import Cluster
from parallel.planner.compute import microbatch_seconds
from parallel.planner.predict import ACT_BYTES
from parallel.planner.timing import forward_flops_per_token
from parallel.pp.schedules import SCHEDULES
from parallel.pp.split import SplitError
from parallel.tp.options import TPOptions
from parallel.tp.theory import tp_tensors_per_layer


def step_time_floor(shape: ModelShape, cluster: Cluster, world: int, global_batch: int):
    """`floor(request, spec) -> seconds`: no layout the request asks for of the registry entry `spec` is
    predicted faster (the module's docstring says why each term holds; without `spec`, no communication
    is counted). 0 for a request run_plan.py will refuse anyway."""
    device, rate = cluster.device(), cluster.flops_per_rank(world)
    act_bytes = ACT_BYTES[cluster.precision]
    link = max(cluster.intra_bytes_per_s, cluster.inter_bytes_per_s) * cluster.comm_efficiency
    g = shape.gpt

    @lru_cache(maxsize=65536)
    def rank_seconds(t: int, b: int, blocks: int, last: bool, recompute: str, cp: int) -> float:
        """A floor under F + B of one microbatch on a rank holding `blocks` blocks (and the head if `last`)
        and b·s/cp of its tokens: under either kind of context parallelism (they shape attention apart)."""
        if device is None:
            return 3 * b * (shape.gpt.seq_len // cp) * forward_flops_per_token(shape, t, blocks, last) / rate
        kinds = CP_KINDS if cp > 1 else CP_KINDS[:1]  # at cp 1 every kind is the same GEMMs
        return min(sum(microbatch_seconds(shape, device, t, b, blocks, last, act_bytes, True, recompute, cp,
                                          kind)[k] for k in ("forward", "backward")) for kind in kinds)

    def tp_seconds(spec, request: dict, b: int, recompute: str) -> float:
        """The tp collectives' seconds per step on the mean rank (module docstring), for an entry that cuts tp."""
        t, p, m = request["tp"], request["pp"], request["microbatches"]
        if t == 1 or spec is None or not spec.uses(TPOptions):
            return 0.0
        tensor = b * (g.seq_len // request.get("cp", 1)) * g.d_model * act_bytes
        tensors = tp_tensors_per_layer(recompute) - (2 if cluster.tp_backward_overlap else 0)
        return m * g.n_layers / p * tensors * 2 * (t - 1) / t * tensor / link

    def floor(request: dict, spec=None) -> float:
        dp, t, p, m = request["dp"], request["tp"], request["pp"], request["microbatches"]
        if global_batch % (dp * m):
            return 0.0
        schedule, v = request.get("schedule", "1f1b"), request.get("virtual_stages", 1)
        layers = _rank_layers(shape.gpt, p, v, _tuple(request.get("pp_layers")), schedule) if p > 1 \
            else (shape.gpt.n_layers,)
        if layers is None:
            return 0.0
        b, recompute = global_batch // (dp * m), request.get("recompute") or "none"
        ranks = [rank_seconds(t, b, n, r == p - 1, recompute, request.get("cp", 1)) for r, n in _distinct(layers)]
        blocking = tp_seconds(spec, request, b, recompute)
        share = _bubble_share(schedule, p, m, v) if p > 1 else 0
        return float(m * max(ranks) + blocking + share * (min(ranks) + blocking / m))

    return floor


def _tuple(value):
    return tuple(value) if value is not None else None


def _distinct(layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """(rank, blocks) of the ranks whose figures can differ: the last rank (the head), and one rank of
    each other block count."""
    out, seen = [(len(layers) - 1, layers[-1])], set()
    for r, n in enumerate(layers[:-1]):
        if n not in seen:
            seen.add(n)
            out.append((r, n))
    return out


@lru_cache(maxsize=4096)
def _rank_layers(gpt, p: int, v: int, pp_layers, schedule: str) -> tuple[int, ...] | None:
    """Blocks each pipeline rank holds (compose.theory.stage_layers, as timing.py reads them), or None where
    the layers do not split so (run_plan.py refuses the request)."""
    try:
        return tuple(stage_layers(gpt, ParallelDims.resolve(p, pp=p), v, pp_layers, schedule))
    except (SplitError, ValueError):
        return None


@lru_cache(maxsize=65536)
def _bubble_share(schedule: str, p: int, m: int, v: int) -> Fraction:
    """The largest min(a, c) over the schedule's idle chains a·F + c·B with a, c >= 0: the bubble is at
    least that times F + B (module docstring); 0 where no closed form is claimed."""
    record = SCHEDULES.get(schedule)
    if record is None or record.idle is None:
        return Fraction(0)
    try:
        forward = record.idle(p, m, v, 1, 0, 0)
        whole = record.idle(p, m, v, 0, 1, 0)
        split = record.idle(p, m, v, 0, Fraction(1, 2), Fraction(1, 2))
    except (ValueError, ZeroDivisionError):  # sizes the formula does not take: the schedule refuses them too
        return Fraction(0)
    if forward is None or whole is None or split is None:
        return Fraction(0)
    shares = [min(a, c1, c2) for a, c1, c2 in zip(forward, whole, split) if min(a, c1, c2) >= 0]
    return Fraction(max(shares, default=0))
