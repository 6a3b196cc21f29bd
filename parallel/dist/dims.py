"""The parallel layout's dimensions, declared once, and the layout itself, validated before any group.

Every dimension of the project is one row of `DIMS`, innermost first; everything else (the layout's
sizes, the device mesh, the process groups, the planner's search) iterates over these rows:

    name   mesh  splits                                   a group: the ranks that share
    tp     yes   each layer's weights (heads, MLP width,  pp, dp, cp   (neighbours: one node)
                 vocabulary)
    cp     yes   the sequence                             pp, dp, tp
    ep     no    the experts of each MoE layer            pp, cp, tp, edp  (ep consecutive dp ranks)
    dp_shard no  the model state (HSDP: ZeRO inside       pp, cp, tp, dp_replicate (dp_shard consecutive
                 groups of dp_shard ranks)                dp ranks: one node)
    dp     yes   the batch                                pp, cp, tp
    pp     yes   the layers                               dp, cp, tp
    edp    no    (the ranks that hold the same experts    pp, cp, tp, ep   (made where ep > 1)
                 and sum their gradients)
    dp_cp  no    (dp and cp together: the ranks that sum  pp, tp           (made where cp > 1)
                 gradients when the sequence is split)
    dp_replicate no (HSDP: the ranks that hold the same   pp, cp, tp, dp_shard     (made where dp_shard > 1)
                 shard and sum it across shard groups)

Rank order puts tp innermost, then cp, then dp, then pp outermost (Megatron's order), so that the
ranks of one tensor-parallel group are neighbours and stay inside one node, and context-parallel
neighbours (ring attention's point-to-point traffic) come next:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

which is exactly the row-major order of a device mesh of shape (pp, dp, cp, tp) (`MESH_DIMS`).

Expert parallelism is not a dimension of the mesh: the ep ranks of an MoE layer are `ep`
consecutive dp ranks (ep divides dp), as Megatron-Core carves expert parallelism out of data
parallelism. A rank's expert-parallel index is dp_rank % ep, and the ranks that hold the same
experts (and sum their gradients) share dp_rank // ep (`edp`, expert data parallel).

Hybrid sharding (HSDP) is carved out of dp the same way: its shard groups are `dp_shard` consecutive
dp ranks (dp_shard divides dp), so with ranks placed node by node a shard group lies inside a node
whenever dp_shard divides the processes per node; a rank's shard index is dp_rank % dp_shard, and the
ranks with the same shard index (and so the same shard of the model state) share
dp_rank // dp_shard (`dp_replicate`: dp / dp_shard groups' worth of replicas, the slow links' group).

The words, written down once. A *dimension* (dim) is one way of splitting the ranks, a row of `DIMS`
(a tensor's dimension is always called a tensor dimension). Three sets of them have names, and only
these: `SIZES`, the dimensions with a size of their own (parallel.dp, .tp, .pp, .cp, .ep), the
fields of `ParallelDims` in the order every message and command line names them (dp_shard: HSDP's); `MESH_DIMS`, the
device mesh's (pp, dp, cp, tp), outermost first, which is also the DeviceMesh's dim names; and
`DERIVED_DIMS`, the groups read off the others (ep, dp_shard, edp, dp_cp, dp_replicate).
`outermost_first` puts any of them in rank order. A row with a size and no field (or a field with no
row) fails at import. A new dimension is a row here and a field of `ParallelDims` (and its place in
`coordinates` if it is carved out of another, as ep and dp_shard are out of dp).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from math import gcd as _gcd


@dataclass(frozen=True)
class Dim:
    """One dimension: its name, what it splits, and how its groups are formed."""

    name: str
    splits: str
    mesh: bool  # a dimension of the device mesh (its groups are the mesh's own) or a derived group
    sized: bool = True  # a size of its own, parallel.<name> (edp and dp_cp have none: they are read off dp, ep, cp)
    shares: tuple[str, ...] = ()  # derived groups: the coordinates all ranks of one group have in common
    made_when: str | None = None  # derived groups: the size that must exceed 1 for the group to be made
    inside: str | None = None  # a size carved out of another mesh dimension's ranks (ep out of dp): divides it
    sums_gradients: bool = False  # its groups are replicas that sum gradients (a data-parallel group)


# Innermost first: the mesh's rows in this order are its rank order (tp fastest).
DIMS: tuple[Dim, ...] = (
    Dim("tp", "each layer's weights (heads, MLP width, vocabulary)", mesh=True),
    Dim("cp", "the sequence", mesh=True),
    Dim("ep", "the experts of each MoE layer (ep consecutive dp ranks)", mesh=False,
        shares=("pp", "cp", "tp", "edp"), made_when="ep", inside="dp"),
    Dim("dp_shard", "the model state, ZeRO-sharded over dp_shard consecutive dp ranks (HSDP)", mesh=False,
        shares=("pp", "cp", "tp", "dp_replicate"), made_when="dp_shard", inside="dp", sums_gradients=True),
    Dim("dp", "the batch", mesh=True, sums_gradients=True),
    Dim("pp", "the layers", mesh=True),
    Dim("edp", "nothing: the dp ranks that hold the same experts and sum their gradients", mesh=False, sized=False,
        shares=("pp", "cp", "tp", "ep"), made_when="ep", sums_gradients=True),
    Dim("dp_cp", "nothing: dp and cp together, the ranks that sum gradients when the sequence is split",
        mesh=False, sized=False, shares=("pp", "tp"), made_when="cp", sums_gradients=True),
    Dim("dp_replicate", "nothing: the dp ranks that hold the same shard (HSDP) and sum it across shard groups",
        mesh=False, sized=False, shares=("pp", "cp", "tp", "dp_shard"), made_when="dp_shard", sums_gradients=True),
)
DIM = {d.name: d for d in DIMS}
MESH_DIMS: tuple[str, ...] = tuple(d.name for d in reversed(DIMS) if d.mesh)  # (pp, dp, cp, tp): outermost first
DERIVED_DIMS: tuple[str, ...] = tuple(d.name for d in DIMS if not d.mesh)  # (ep, dp_shard, edp, ...): enumerated
# The data-parallel groups: dp, dp with cp, the experts' edp, HSDP's shard and replicate halves of dp.
DATA_PARALLEL: tuple[str, ...] = tuple(d.name for d in DIMS if d.sums_gradients)
# The dimension a layout's world leaves when the others are given (ParallelDims.resolve, the planner's search).
LEFTOVER = "dp"


def outermost_first(names) -> tuple[str, ...]:
    """Dimension names in rank order, the slowest-varying first (pp, dp, ep, cp, tp): how rank labels read."""
    order = [d.name for d in reversed(DIMS)]
    return tuple(sorted(names, key=order.index))


def shared_coordinates(name: str) -> tuple[str, ...]:
    """The coordinates every rank of one `name` group has in common: a mesh dimension's groups
    share every other mesh coordinate; a derived group's are declared in its row."""
    d = DIM[name]
    return tuple(n for n in MESH_DIMS if n != name) if d.mesh else d.shares


class LayoutError(ValueError):
    """A layout that cannot run; the message names the value, the rule and a fix."""


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name}={value!r} must be a positive integer")
    return value


def _product(names: list[str], values: list[int]) -> str:
    """`parallel.dp x parallel.tp = 2 x 2 = 4`"""
    total = 1
    for v in values:
        total *= v
    return f"{' x '.join(f'parallel.{n}' for n in names)} = {' x '.join(map(str, values))} = {total}"


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks along each sized dimension of `DIMS` (one field each), and the world they fill."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1

    @classmethod
    def resolve(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int | None = 1, cp: int = 1,
                ep: int = 1, dp_shard: int = 1) -> ParallelDims:
        """Fill in dp (or pp) from what the world leaves, then check the product.

        Whichever of dp and pp is given, the other is derived; with neither given (the pipeline
        presets), dp is 1 and every other rank is a pipeline stage. So `parallel=pp_1f1b
        parallel.pp=2` on 4 ranks is dp 2 x pp 2, and `parallel=pp_1f1b` alone is pp 4.
        (cp appears in the messages only where it is used: cp = 1 reads as it always did.)"""
        world_size = _positive_int("world size", world_size)
        tp = _positive_int("parallel.tp", tp)
        cp = _positive_int("parallel.cp", cp)
        # The mesh dimensions inside dp (cp, tp): named in the messages where used, the innermost always.
        given = {"cp": cp, "tp": tp}
        inner_dims = [n for n in MESH_DIMS if n not in (LEFTOVER, "pp")]
        inner_names = [n for n in inner_dims if given[n] > 1 or n == inner_dims[-1]]
        inner = [given[n] for n in inner_names]
        inner_size = cp * tp
        if pp is None:
            dp = 1 if dp is None else _positive_int("parallel.dp", dp)
            if world_size % (dp * inner_size):
                raise LayoutError(
                    f"world size {world_size} is not divisible by {_product(['dp', *inner_names], [dp, *inner])}: "
                    f"launch a multiple of {dp * inner_size} processes or change {'/'.join(['dp', *inner_names])}"
                )
            pp = world_size // (dp * inner_size)
        pp = _positive_int("parallel.pp", pp)
        if dp is None:
            if world_size % (inner_size * pp):
                raise LayoutError(
                    f"world size {world_size} is not divisible by {_product([*inner_names, 'pp'], [*inner, pp])}: "
                    f"launch a multiple of {inner_size * pp} processes or change {'/'.join([*inner_names, 'pp'])}"
                )
            dp = world_size // (inner_size * pp)
        dp = _positive_int("parallel.dp", dp)
        if dp * inner_size * pp != world_size:
            n = dp * inner_size * pp
            names, values = ["dp", *inner_names, "pp"], [dp, *inner, pp]
            raise LayoutError(
                f"world size {world_size} != {_product(names, values)}: "
                f"launch {n} processes (torchrun --nproc-per-node {n}) or leave parallel.dp unset to derive it"
            )
        ep = _positive_int("parallel.ep", ep)
        if dp % ep:
            raise LayoutError(
                f"parallel.ep={ep} does not divide parallel.dp={dp}: the expert-parallel ranks are ep consecutive "
                f"data-parallel ranks; use an ep that divides dp (e.g. parallel.ep={_gcd(ep, dp)})"
            )
        dp_shard = _positive_int("parallel.dp_shard", dp_shard)
        if dp % dp_shard:
            fits = max(d for d in range(1, max(1, min(dp_shard, dp // 2)) + 1) if dp % d == 0)
            raise LayoutError(
                f"parallel.dp_shard={dp_shard} does not divide parallel.dp={dp}: a shard group is dp_shard consecutive "
                f"data-parallel ranks and dp / dp_shard groups replicate it; use a dp_shard that divides dp "
                f"(e.g. parallel.dp_shard={fits})"
            )
        return cls(world_size=world_size, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The sizes of `MESH_DIMS`, outermost first: (pp, dp, cp, tp)."""
        return tuple(getattr(self, n) for n in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(pp, dp, cp, tp) position of a global rank, and its ep, edp, dp_shard and dp_replicate indices within dp."""
        inner_first: dict[str, int] = {}
        rest = rank
        for name in reversed(MESH_DIMS):  # tp varies fastest
            rest, inner_first[name] = divmod(rest, getattr(self, name))
        c = {name: inner_first[name] for name in MESH_DIMS}
        # ep is carved out of dp: ep consecutive dp ranks, and across them those with the same experts.
        c["ep"], c["edp"] = c["dp"] % self.ep, c["dp"] // self.ep
        # HSDP's shard groups likewise: dp_shard consecutive dp ranks, replicated across them.
        c["dp_shard"], c["dp_replicate"] = c["dp"] % self.dp_shard, c["dp"] // self.dp_shard
        return c

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        at = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        rank = 0
        for name in MESH_DIMS:
            rank = rank * getattr(self, name) + at[name]
        return rank

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of dimension `name` (a row of `DIMS`) as its global ranks: the ranks that
        share the coordinates `shared_coordinates(name)` gives."""
        if name not in DIM:
            raise ValueError(f"no group dimension {name!r}: choose one of {', '.join(DIM)}")
        shared = shared_coordinates(name)
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            groups.setdefault(tuple(c[k] for k in shared), []).append(rank)
        return list(groups.values())

    def groups_in_use(self) -> tuple[str, ...]:
        """The derived groups this layout needs made (their `made_when` size exceeds 1), in `DIMS` order."""
        return tuple(n for n in DERIVED_DIMS if getattr(self, DIM[n].made_when) > 1)

    def check_batch(self, global_batch: int, microbatches: int) -> None:
        """The global batch must split evenly into dp slices and then microbatches."""
        global_batch = _positive_int("train.global_batch", global_batch)
        microbatches = _positive_int("parallel.microbatches", microbatches)
        if global_batch % (self.dp * microbatches):
            need = self.dp * microbatches
            raise LayoutError(
                f"train.global_batch={global_batch} is not divisible by parallel.dp x parallel.microbatches = "
                f"{self.dp} x {microbatches} = {need}: use a global batch that is a multiple of {need} "
                f"(e.g. train.global_batch={max(need, global_batch // need * need)})"
            )

    def node_layout_warning(self, local_world_size: int) -> str | None:
        """Whether the tensor-parallel groups stay inside one node, as they should.

        torchrun numbers ranks node by node (node k holds ranks k·n .. k·n+n-1 for n processes per
        node) and tp is the innermost dimension, so each tp group is a run of tp consecutive ranks:
        it stays inside a node exactly when tp divides n. Otherwise the run is still correct, but
        the several collectives per layer that tp makes cross the network; that is worth a warning,
        not a refusal (a job may have no better shape).
        """
        if self.tp == 1 or local_world_size >= self.world_size or local_world_size % self.tp == 0:
            return None
        return (
            f"parallel.tp={self.tp} does not divide the {local_world_size} processes per node, so tensor-parallel "
            "groups span nodes and every tp collective crosses the network: use a tp that divides --nproc-per-node"
        )

    def as_dict(self) -> dict:
        return asdict(self)


# The sizes, in the order the dataclass declares them (parallel.dp, tp, pp, cp, ep, dp_shard: how messages and
# command lines name them); each is a sized row of DIMS.
SIZES: tuple[str, ...] = tuple(f.name for f in fields(ParallelDims) if f.name != "world_size")
if set(SIZES) != {d.name for d in DIMS if d.sized}:
    raise ImportError(f"ParallelDims fields {SIZES} are not the sized rows of DIMS")


def build_device_mesh(dims: ParallelDims, device_type: str, group_options=None):
    """A (pp, dp, cp, tp) DeviceMesh (`MESH_DIMS`) with named dims; each sub-group is reachable as mesh["dp"] etc.

    Sharing one named mesh lets PyTorch's own DDP, FSDP2 and DTensor baselines run on exactly
    the groups the hand-written strategies use. `group_options`: the backend options every
    dimension's group is made with (parallel/dist/groups.py gives them the run's timeout; torch's
    own default would be its backend's, minutes, whatever the default group was given).
    """
    from torch.distributed.device_mesh import init_device_mesh

    override = {name: group_options for name in MESH_DIMS} if group_options is not None else None
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=MESH_DIMS, backend_override=override)
