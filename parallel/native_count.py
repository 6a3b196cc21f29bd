"""Counting the collectives PyTorch's own parallelism issues, into the same communication log.

DTensor tensor parallelism and torch.distributed.pipelining call torch.distributed themselves, not
through `comm.py`. Both reach the dispatcher, though: every c10d call (`c10d::allreduce_`,
`c10d::send`, ...) and every functional collective (`_c10d_functional::all_reduce`, ...) is an
operator, and a TorchDispatchMode sees each one with its tensors and its process group. This mode
records each such call in the CommLog as `comm.py` would have (same op names, payload and ring
bytes, the group under the project's name), so a baseline's summary has the same schema as ours.

Ops on DTensor are let through first (returning NotImplemented), so DTensor turns them into local
ops and collectives, which come back here as plain-tensor ops: the trick torch's own
CommDebugMode uses (its module tracker fails on this model in torch 2.13: IndexError in
_fw_set_module_hook, which is why it is not used).

Time: the host time of each call is recorded, and for functional collectives the time blocked in
`wait_tensor` is charged to the collective whose output it waits for. c10d calls return a Work that the
caller waits on outside the dispatcher, so for them only the posting time is seen.
"""

from __future__ import annotations

import time

import torch
import torch.utils._pytree as pytree
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .comm import CommLog, Communicator, tensor_bytes

# operator name -> (the project's op name, how its payload is read from the arguments)
#   "first": the first tensor (or the tensors of the first list), "all": every tensor of the first
#   list argument, "gathered": the input times the group size (an all-gather's full output),
#   "second": the second argument (the full input of a reduce-scatter / full output of all-gather)
C10D_OPS = {
    "allreduce_": ("all_reduce", "first"),
    "allreduce_coalesced_": ("all_reduce", "first"),
    "broadcast_": ("broadcast", "first"),
    "send": ("send", "first"),
    "recv_": ("recv", "first"),
    "recv_any_source_": ("recv", "first"),
    "allgather_": ("all_gather", "first"),  # (output lists, inputs): outputs are the full tensor
    "_allgather_base_": ("all_gather", "first"),
    "reduce_scatter_": ("reduce_scatter", "second"),
    "_reduce_scatter_base_": ("reduce_scatter", "second"),
    "alltoall_": ("all_to_all", "second"),
    "alltoall_base_": ("all_to_all", "second"),
    "barrier": ("barrier", "none"),
}
FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", "first"),
    "all_reduce_": ("all_reduce", "first"),
    "all_reduce_coalesced": ("all_reduce", "first"),
    "all_gather_into_tensor": ("all_gather", "gathered"),
    "all_gather_into_tensor_out": ("all_gather", "gathered"),
    "reduce_scatter_tensor": ("reduce_scatter", "first"),
    "all_to_all_single": ("all_to_all", "first"),
    "broadcast": ("broadcast", "first"),
    "broadcast_": ("broadcast", "first"),
}
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _bytes_of(arg) -> int:
    return sum(tensor_bytes(t) for t in pytree.tree_leaves(arg) if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Records every collective issued inside it into `log`, under the tag `<prefix>/<op>`.

    `comms` are the run's communicators: a call on one of their process groups is logged under
    that communicator's name ("tp", "dp", "pp", ...). A call on any other group is an error,
    because it would be traffic the summary cannot place.
    """

    def __init__(self, log: CommLog, comms: list[Communicator], tag_prefix: str):
        super().__init__()
        self.log = log
        self.prefix = tag_prefix
        self.names = {c.group.group_name: (c.name, c.size) for c in comms if c is not None}
        self._awaiting: dict[str, tuple[str, str]] = {}

    def _group(self, args, kwargs) -> tuple[str, int]:
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.ScriptObject):
                try:
                    group_name = ProcessGroup.unbox(a).group_name
                except RuntimeError:
                    continue  # a ReduceOp, not the group
                return self._known(group_name)
            if isinstance(a, str) and a in self.names:
                return self.names[a]
        raise RuntimeError(f"collective without a process group the log knows: {args}")

    def _known(self, group_name: str) -> tuple[str, int]:
        if group_name not in self.names:
            raise RuntimeError(f"a collective on process group {group_name!r}, which is none of the run's "
                               f"communicators ({sorted(self.names)}): its traffic could not be placed")
        return self.names[group_name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        # (Other subclasses pass through: DTensor's sharding propagation runs ops on FakeTensors.)
        name = func._opname
        if func.namespace in FUNCTIONAL_NAMESPACES and name == "wait_tensor":
            return self._timed_wait(func, args, kwargs)
        if func.namespace == "c10d" and name in C10D_OPS:
            op, rule = C10D_OPS[name]
        elif func.namespace in FUNCTIONAL_NAMESPACES and name in FUNCTIONAL_OPS:
            op, rule = FUNCTIONAL_OPS[name]
        else:
            return func(*args, **kwargs)
        group, size = self._group(args, kwargs)
        if rule == "first":
            payload = _bytes_of(args[0])
        elif rule == "second":
            payload = _bytes_of(args[1])
        elif rule == "gathered":
            payload = _bytes_of(args[0]) * size
        else:
            payload = 0
        tag = f"{self.prefix}/{op}"
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.log.record(op, group, tag, payload, size, time.perf_counter() - start if self.log.timed else 0.0)
        if func.namespace in FUNCTIONAL_NAMESPACES:
            self._awaiting[id(out)] = (op, group, tag)
        return out

    def _timed_wait(self, func, args, kwargs):
        start = time.perf_counter()
        out = func(*args, **kwargs)
        key = self._awaiting.pop(id(args[0]), None)
        if key is not None and self.log.timed:
            self.log.add_seconds(*key, time.perf_counter() - start)
        return out
