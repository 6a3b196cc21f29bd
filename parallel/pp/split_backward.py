"""One chunk's backward in two halves: B, the gradient of its input, and W, those of its weights.

The whole backward of `out = chunk(x)` walks autograd's graph from `out` down to every leaf: the
input x and the weights. Zero-bubble schedules (zero_bubble.py) run it as two actions at
different times (Qi et al. 2023, arXiv 2401.10241, §2):

  B  the gradient of x, which the previous stage is waiting for. It walks only the *spine*: the
     nodes on some path from `out` down to x. A weight's branch leaves the spine at a node of
     the spine, its *fork* (a linear layer's matmul, a LayerNorm, an added bias); when B passes
     a fork, the gradient arriving there is kept.
  W  the weights' gradients: from each fork's kept gradient, the walk goes on down the weights'
     branches only, into the parameters' `.grad` (autograd's AccumulateGrad, so the
     post-accumulate-grad hooks fire as they would in a whole backward).

Nothing is computed twice: autograd runs a node only for the outputs its walk needs, so B gets
a matmul's input gradient from the fork and W its weight gradient. The two halves do the whole
backward's arithmetic on the same numbers (tests/unit/test_pp_split_backward.py compares them).

The graph outlives B (autograd.grad(..., retain_graph=True)): what the forward saved is held
until W has run, and then released, which is what the simulator counts (activations held until
W). The first virtual stage has no input gradient to compute (its input is token ids): there B
does nothing and W is the whole backward, as in PyTorch's pipelining.

Weights that share a fork (a LayerNorm's weight and bias), or a weight with several forks (one
used twice), are differentiated together in one call, a *group*. Within a group with several
forks, gradient may flow from one fork down the spine into another; each fork's incoming
gradient is then replaced by the one B kept (which already sums every path), so nothing is
counted twice (the same device as PyTorch's torch/distributed/pipelining/_backward.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node:
    """The node a tensor's gradient enters: its grad_fn, or for a leaf its AccumulateGrad (made
    on demand by autograd, so reached through a throwaway view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(root: Node) -> dict[Node, list[Node]]:
    """node -> the nodes that pass gradient into it (one step closer to `out`)."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _upward(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes above `start` (toward `out`), not going past `stop`; and the stop nodes met."""
    above, met, stack = set(), set(), [start]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in above:
                above.add(parent)
                stack.append(parent)
    return above, met


def _groups(forks_of: dict[torch.Tensor, set[Node]]) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """Weights joined by a shared fork, with all their forks (union-find over the forks)."""
    owner: dict[Node, int] = {}
    groups: list[tuple[set[Node], list[torch.Tensor]]] = []
    for weight, forks in forks_of.items():
        merged = sorted({owner[f] for f in forks if f in owner})
        if merged:
            keep = merged[0]
            for other in merged[1:]:
                groups[keep][0].update(groups[other][0])
                groups[keep][1].extend(groups[other][1])
                groups[other] = (set(), [])
        else:
            keep = len(groups)
            groups.append((set(), []))
        groups[keep][0].update(forks)
        groups[keep][1].append(weight)
        for f in groups[keep][0]:
            owner[f] = keep
    return [(list(forks), weights) for forks, weights in groups if weights]


class SplitBackward:
    """The backward of one chunk-microbatch, `out = chunk(x)`, as B (`input_grad`) then W (`weight_grad`).

    `grad_out`: the gradient of `out` (None when `out` is the loss); `x`: the chunk's input, a leaf
    that requires grad, or None on the first virtual stage; `weights`: the chunk's parameters.
    """

    def __init__(self, out: torch.Tensor, grad_out: torch.Tensor | None, x: torch.Tensor | None,
                 weights: list[torch.Tensor]):
        self.out, self.grad_out, self.x = out, grad_out, x
        self.weights = [w for w in weights if w.requires_grad]
        self.groups: list[tuple[list[Node], list[torch.Tensor]]] = []
        self.kept: dict[Node, tuple] = {}  # fork -> the gradients that arrived at it in B

    def input_grad(self) -> torch.Tensor | None:
        """B: the gradient of x (also left in x.grad); the graph and the forks' gradients are kept for W."""
        if self.x is None:
            return None  # the first stage: W runs the whole backward
        root = grad_node(self.out)
        parents = _parents(root)
        spine, _ = _upward(grad_node(self.x), parents, set())
        forks_of = {}
        for w in self.weights:
            _, forks = _upward(grad_node(w), parents, spine)
            if forks:
                forks_of[w] = forks
        self.groups = _groups(forks_of)

        def keep(fork):
            def hook(grads):
                self.kept[fork] = grads
            return hook

        handles = [f.register_prehook(keep(f)) for forks, _ in self.groups for f in forks]
        try:
            (grad_x,) = torch.autograd.grad(self.out, self.x, self.grad_out, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        self.x.grad = grad_x
        # Only the forks are needed now: dropping `out` lets the nodes above them go (the loss's).
        self.out = self.grad_out = None
        return grad_x

    def weight_grad(self) -> None:
        """W: accumulate every weight's gradient into its .grad; the graph is released."""
        if self.x is None:
            torch.autograd.backward(self.out, self.grad_out, inputs=self.weights)
            self.out = self.grad_out = None
            return
        for forks, weights in self.groups:
            edges, grads = [], []
            for f in forks:
                for i, g in enumerate(self.kept[f]):
                    if g is not None:
                        edges.append(GradientEdge(f, i))
                        grads.append(g)
            # Several forks in one group: what reaches a fork from another in this walk was already
            # in the gradient B kept there, so the kept gradient replaces the sum.
            handles = ([f.register_prehook(lambda _, kept=self.kept[f]: kept) for f in forks]
                       if len(forks) > 1 else [])
            try:
                torch.autograd.backward(edges, grads, inputs=weights)
            finally:
                for h in handles:
                    h.remove()
        self.groups, self.kept = [], {}
