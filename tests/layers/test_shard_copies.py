"""The planner's table of the sharded strategies' copies (parallel/planner/shard_copies.py) against the code.

On 2 gloo ranks a small GPT takes a step of zero3, zero2 and torch_fsdp2 with one and with two
microbatches, and one process takes one microbatch's step alone, under a dispatch mode that adds up
the bytes every torch operation reads and writes: its tensor arguments, but for what it only
overwrites (copy_'s and zero_'s destination, an `out=` argument) and for a buffer it hands back
unread (FSDP2's all_gather_copy_in), and its outputs but for those arguments; 0-d tensors (the loss)
aside. The optimizer's step (optimizer_step.py's) and the transport (the Communicator's calls) are
not counted. What a
strategy's step moves beyond m times the lone microbatch's forward and backward must be the table's
bytes per element times the model's parameters, exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dispatch_pause import PausableMode
from spawn import run_ranks, write_result
from torch.utils._pytree import tree_flatten

from parallel.planner.codec import work_bytes_per_element
from parallel.planner.shard_copies import copy_passes
from parallel.registry import spec_of

WORLD = 2
OVERWRITTEN = ("copy_", "zero_", "fill_")  # the first argument: written, not read


class ByteCounter(PausableMode):
    """The bytes every operation reads and writes, by operation."""

    def __init__(self):
        super().__init__()
        self.bytes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.inside or func.is_view or name.startswith("empty"):
            return out
        kwargs = kwargs or {}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        read, written = [], []
        for i, arg in enumerate(func._schema.arguments):
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            writes = arg.alias_info is not None and arg.alias_info.is_write
            if writes:
                written += tensors
            handed_back = not writes and any(t is o for t in tensors for o in outputs)
            if not handed_back and not (i == 0 and name in OVERWRITTEN) and not (writes and arg.kwarg_only):
                read += tensors
        arguments = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        written += [o for o in outputs if not any(o is t for t in arguments)]
        # 0-d tensors left out: the step's loss bookkeeping, once per step however many microbatches.
        self.bytes[name] += sum(t.numel() * t.element_size() for t in read + written if t.dim())
        return out


def _model():
    from parallel.core.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2), seed=0)


def _counted_step(strategy, comms, microbatches: int, rank: int) -> int:
    """The bytes of one step after a first (FSDP2 sets itself up in its first)."""
    from parallel.core.data import Batch

    x = torch.randint(0, 256, (microbatches, 2, 17), generator=torch.Generator().manual_seed(rank))
    batches = [Batch(b[:, :-1], b[:, 1:]) for b in x]
    strategy.guard_finite = lambda _loss: None
    strategy.train_step(batches, 32 * microbatches)
    counter = ByteCounter()
    for comm in comms:
        comm._run = counter.pause(comm._run)
    strategy.optimizer.step = counter.pause(strategy.optimizer.step)
    with counter:
        strategy.train_step(batches, 32 * microbatches)
    return sum(counter.bytes.values())


def _built(name: str, comm, mesh):
    from parallel.baselines.fsdp2 import TorchFSDP2
    from parallel.zero.strategy import ZeroDataParallel
    from parallel.zero.zero3 import Zero3

    if name == "torch_fsdp2":
        return TorchFSDP2(_model(), mesh, comm, 1e-3, 0.1)
    return Zero3(_model(), comm, 1e-3, 0.1) if name == "zero3" else ZeroDataParallel(_model(), comm, 2, 1e-3, 0.1)


def _counted(rank: int, world: int, out_dir, *_):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from parallel.dist.comm import CommLog, Communicator
    from parallel.strategy import SingleProcess, make_optimizer
    from parallel.sync.shards import group_into_parts

    model = _model()
    found = {"parts": [p.numel for p in group_into_parts(list(model.named_parameters()), 1, 0)],
             "single": _counted_step(SingleProcess(model, make_optimizer(model, 1e-3, 0.1)), [], 1, rank)}
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for m in (1, 2):
        for name in ("zero3", "zero2", "torch_fsdp2"):
            comm = Communicator("dp", dist.group.WORLD, CommLog())
            found[f"{name}/{m}"] = _counted_step(_built(name, comm, mesh), [comm], m, rank)
    write_result(out_dir, rank, found)


@pytest.fixture(scope="module")
def counted() -> dict:
    return run_ranks(WORLD, _counted)[0]


@pytest.mark.parametrize("name, zero", [("zero3", 3), ("zero2", 2), ("torch_fsdp2", 3)])
@pytest.mark.parametrize("m", [1, 2])
def test_the_copies_move_the_tables_bytes(counted, name, zero, m):
    parts = counted["parts"]
    table = work_bytes_per_element(copy_passes(spec_of(name).tags, zero, WORLD, m, parts))
    assert table > 0
    assert counted[f"{name}/{m}"] - m * counted["single"] == table * sum(parts)
