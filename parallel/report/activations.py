"""Activation memory, measured: the bytes autograd holds for backward, at their peak in a step.

Every tensor a forward op saves for its backward goes through `torch.autograd.graph`'s
saved-tensor hooks. `ActivationMeter` installs a pack hook that wraps each saved tensor in a small
holder: the bytes of its storage are counted when the first holder of that storage is made and
uncounted when the last one is released, which autograd does when the backward node that needed
it has run (or the graph is dropped). So the meter follows exactly what is saved for backward,
whatever the strategy (pipelines with several microbatches in flight, PyTorch's own
implementations, recomputation that saves less), on every rank.

What counts: distinct storages (two saved views of one tensor count once), not parameters (a
linear layer saves its weight, which is model state, not activation memory: an nn.Parameter, a
view of one, or a tensor on the storage of a parameter given at construction, such as a DTensor's
local shard, is left out), nothing that has no storage.

Recomputation: this project's (parallel/core/recompute.py, train.recompute) keeps a region's inputs
with `save_for_backward` and runs the region again in backward under the same hooks, so the meter
sees all of it: the kept inputs, and the recomputed region's tensors while its backward runs
(docs/theory/memory.md derives both). torch.utils.checkpoint's non-reentrant regions would be
half out of sight: their inputs are saved through autograd (counted), but what they recompute in
backward is packed by hooks of their own into the checkpoint's frame, so the peak that full
recomputation reaches in backward would be missed.

The figure is bytes, per rank, at the step's peak (`peak`), reset at every step.
"""

from __future__ import annotations

import contextlib

import torch


class _Saved:
    """What autograd keeps in place of a saved tensor; releasing it uncounts the tensor's storage."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class ActivationMeter:
    def __init__(self, parameters=()):
        # DTensor parameters: their local shards are what ops save.
        local = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]
        self.excluded = {t.untyped_storage().data_ptr() for t in local if t.untyped_storage().nbytes()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, holders]
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, t: torch.Tensor):
        if _is_parameter(t):
            return t
        # A DTensor holds its memory in its local shard; a tensor subclass with no storage of its
        # own (and no local shard) holds none that could be counted here.
        local = getattr(t, "_local_tensor", t)
        try:
            storage = local.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        if key in self.excluded or storage.nbytes() == 0:
            return t
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        # Detached: a saved *output* of an op (softmax's, exp's) holds its grad_fn, the node that
        # holds this holder: a cycle through C++ that Python's collector cannot see, which would
        # keep the node and the tensor alive for ever when the graph is dropped without the node
        # having run (split backward's B: parallel/pp/split_backward.py). The values are the same.
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    @contextlib.contextmanager
    def step(self):
        """Measure one step: the peak starts from what is held now (nothing, between steps)."""
        self.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
