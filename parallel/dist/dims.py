"""The parallel layout: how many ranks along each dimension, validated before any process group.

Rank order puts tp innermost, then cp, then dp, then pp outermost (Megatron's order), so that the
ranks of one tensor-parallel group are neighbours and stay inside one node, and context-parallel
neighbours (ring attention's point-to-point traffic) come next:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

which is exactly the row-major order of a device mesh of shape (pp, dp, cp, tp).

Expert parallelism is not a dimension of its own: the ep ranks of an MoE layer are `ep`
consecutive dp ranks (ep divides dp), as Megatron-Core carves expert parallelism out of data
parallelism. A rank's expert-parallel index is dp_rank % ep, and the ranks that hold the same
experts (and sum their gradients) share dp_rank // ep (`edp`, expert data parallel).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import gcd as _gcd

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")


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
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @classmethod
    def resolve(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int | None = 1, cp: int = 1,
                ep: int = 1) -> "ParallelDims":
        """Fill in dp (or pp) from what the world leaves, then check the product.

        Whichever of dp and pp is given, the other is derived; with neither given (the pipeline
        presets), dp is 1 and every other rank is a pipeline stage. So `parallel=pp_1f1b
        parallel.pp=2` on 4 ranks is dp 2 x pp 2, and `parallel=pp_1f1b` alone is pp 4.
        (cp appears in the messages only where it is used: cp = 1 reads as it always did.)"""
        world_size = _positive_int("world size", world_size)
        tp = _positive_int("parallel.tp", tp)
        cp = _positive_int("parallel.cp", cp)
        inner_names, inner = (["cp", "tp"], [cp, tp]) if cp > 1 else (["tp"], [tp])
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
            names = ["dp", *inner_names, "pp"] if cp > 1 else ["dp", "tp", "pp"]
            values = [dp, *inner, pp] if cp > 1 else [dp, tp, pp]
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
        return cls(world_size=world_size, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(pp, dp, cp, tp) position of a global rank, and its ep and edp indices within dp."""
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.dp * self.cp * self.tp)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": dp % self.ep, "edp": dp // self.ep}

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of dimension `name` as its global ranks: "pp", "dp", "cp", "tp" (the mesh's),
        "ep" (ep consecutive dp ranks), "edp" (the dp ranks holding the same experts), "dp_cp" (dp
        and cp together: the ranks that sum gradients when the sequence is split too)."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            if name in ("pp", "dp", "cp", "tp"):
                key = tuple(v for k, v in c.items() if k in ("pp", "dp", "cp", "tp") and k != name)
            elif name == "ep":
                key = (c["pp"], c["cp"], c["tp"], c["edp"])
            elif name == "edp":
                key = (c["pp"], c["cp"], c["tp"], c["ep"])
            elif name == "dp_cp":
                key = (c["pp"], c["tp"])
            else:
                raise ValueError(f"no group dimension {name!r}")
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

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

    def check_tensor_parallel(self, model, sequence_parallel: bool) -> None:
        """The model must split evenly over tp ranks (`model` is a parallel.core.model.GPTConfig).

        Heads are split whole, so n_heads % tp == 0; then d_model = n_heads·head_dim and the MLP
        width mlp_ratio·d_model divide by tp as well, and the Q/K/V, output projection, fc and
        proj shards are all whole. The padded vocabulary is split for the embedding and the head;
        the sequence, under sequence parallelism, for everything between the regions.
        """
        t = self.tp
        if t == 1:
            return
        if model.n_heads % t:
            options = [d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0]
            listed = ", ".join(map(str, options[:-1])) + f" or {options[-1]}" if len(options) > 1 else str(options[0])
            raise LayoutError(
                f"model.n_heads={model.n_heads} is not divisible by parallel.tp={t}: "
                f"use a tp that divides the head count ({listed})"
            )
        vocab = model.padded_vocab_size
        if vocab % t:
            multiple = model.vocab_pad_multiple * t // _gcd(model.vocab_pad_multiple, t)
            raise LayoutError(
                f"the padded vocabulary {vocab} (model.vocab_size={model.vocab_size} rounded up to a multiple of "
                f"model.vocab_pad_multiple={model.vocab_pad_multiple}) is not divisible by parallel.tp={t}: "
                f"pad to a multiple of tp, e.g. model.vocab_pad_multiple={multiple}"
            )
        if sequence_parallel and model.seq_len % t:
            raise LayoutError(
                f"model.seq_len={model.seq_len} is not divisible by parallel.tp={t}, and sequence parallelism cuts "
                f"each sequence into tp pieces: use a seq_len that is a multiple of {t}, or parallel=tp without it"
            )
        if model.dropout:
            raise LayoutError(
                f"model.dropout={model.dropout} with parallel.tp={t}: each tp rank would draw its own dropout mask on "
                "activations that must stay identical across the group, and the replicas would drift apart: "
                "set model.dropout=0"
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


def build_device_mesh(dims: ParallelDims, device_type: str):
    """A (pp, dp, cp, tp) DeviceMesh with named dims; each sub-group is reachable as mesh["dp"] etc.

    Sharing one named mesh lets PyTorch's own DDP, FSDP2 and DTensor baselines run on exactly
    the groups the hand-written strategies use.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
