"""Which links a group's traffic crosses: inside a node or between nodes.

Ranks are numbered as parallel/dist/dims.py numbers them (tp innermost, then cp, dp, pp) and
placed on nodes in order, `gpus_per_node` to a node (torchrun's numbering: node k holds ranks
k·G .. k·G + G-1). For every group of one dimension, from `ParallelDims.group_ranks`:

* a collective over its N members spread over k nodes, in one of two algorithms:
    ring          (gloo; NCCL's flat ring) each member sends its share to the next member in rank
                  order; k of the N edges cross nodes when the members sit in k runs of
                  consecutive ranks: a fraction (edges crossing) / N of the bytes goes between nodes;
    hierarchical  (NCCL across nodes) reduce-scatter inside each node, the all-reduce of the
                  1/g pieces across the k nodes, all-gather inside (g = N/k members per node):
                  per rank 2(g-1)/g·S inside and 2(k-1)/k·S/g between, a fraction (k-1)/(N-1) of
                  the ring total 2(N-1)/N·S, which it equals (the same for all-gather and
                  reduce-scatter alone). So the bytes a group sends are theory's, only split.
* an all-to-all (the int8 and fp8 reductions' scatter) sends its block to every other member
  directly, whatever the algorithm: the share of the members' peers on other nodes crosses
  (`direct_fraction`);
* the pipeline's sends cross the boundary between virtual stage j and j + 1, from rank j mod p to
  rank (j + 1) mod p of the pp group: a boundary either stays in a node or crosses.

`flows_per_node` counts how many of a dimension's transfers leave one node at once, for links a
node's ranks share (this machine's emulated nodes have one link each).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from parallel.dist.dims import ParallelDims


@dataclass(frozen=True)
class GroupSpan:
    """How one dimension's groups sit on nodes (the mean over its groups where they differ)."""

    name: str
    size: int  # N, members per group
    nodes: float  # k, nodes a group spans
    inter_fraction: Fraction  # share of the group's bytes that cross between nodes
    flows_per_node: float  # transfers leaving one node at once, over all groups of the dimension
    direct_fraction: Fraction = Fraction(0)  # the same for an all-to-all: the share of its peers off-node

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1


def node_of(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


@lru_cache(maxsize=4096)
def group_span(dims: ParallelDims, name: str, gpus_per_node: int, algorithm: str, virtual: int = 1) -> GroupSpan:
    groups = dims.group_ranks(name)
    size = len(groups[0])
    nodes_total = max(1, -(-dims.world_size // gpus_per_node))
    if size == 1:
        return GroupSpan(name, 1, 1, Fraction(0), 0.0)
    fractions, spans, crossing, direct = [], [], 0, []
    for members in groups:
        on = [node_of(r, gpus_per_node) for r in members]
        k = len(set(on))
        spans.append(k)
        direct.append(Fraction(sum(a != b for a in on for b in on), size * (size - 1)))
        if name == "pp":
            edges = [(j % size, (j + 1) % size) for j in range(size * virtual - 1)]
            cross = sum(on[a] != on[b] for a, b in edges)
            fractions.append(Fraction(cross, len(edges)))
            crossing += 2 * cross  # a boundary carries activations one way and gradients the other
        elif algorithm == "ring":
            cross = sum(on[i] != on[(i + 1) % size] for i in range(size))
            fractions.append(Fraction(cross, size))
            crossing += cross
        else:
            fractions.append(Fraction(k - 1, size - 1))
            crossing += (k - 1) * (size // k) if k > 1 else 0  # each member's inter-node piece, in parallel
    return GroupSpan(name, size, sum(spans) / len(spans), sum(fractions, Fraction(0)) / len(fractions),
                     crossing / nodes_total, sum(direct, Fraction(0)) / len(direct))
