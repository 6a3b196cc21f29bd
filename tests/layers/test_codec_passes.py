"""The planner's codec passes (parallel/planner/codec.py) against the operations the collectives run.

On 2 gloo ranks, every low-precision collective of parallel/sync/lowprec.py runs under a dispatch mode
that sees each torch operation: an operation that is not a view and touches tensors of at least a
quarter of the input's elements (the chunks, not the per-block scales) is a pass, and its bytes are
what it reads (its tensor arguments, but for what copy_ and zero_ overwrite) and writes (its outputs);
what the backend does posting a collective (gloo's own copies, fp32's too) is the transport's, not counted.
Their count (a pass over a chunk of 1/N counting 1/N) must be the planner's table's, and their bytes
its bytes per element within the scales' share (4 bytes per 256 elements in a packed chunk), for
bf16, int8 and fp8, all-reduce (with and without error feedback), reduce-scatter and all-gather; and
DiLoCo's outer step's bytes, exactly, over a small GPT's parameters.
"""

from __future__ import annotations

from fractions import Fraction
from functools import partial

import pytest
import torch
from dispatch_pause import PausableMode
from spawn import run_ranks, write_result
from torch.utils._pytree import tree_flatten

from parallel.dist.comm import CommLog, Communicator
from parallel.planner import codec
from parallel.sync.lowprec import LowPrecisionCollectives

WORLD = 2
N = 256 * 64 * WORLD  # whole blocks in every chunk
NOT_READ = ("copy_", "zero_", "fill_")  # what these overwrite, they do not read


class PassCounter(PausableMode):
    """Every pass over at least `floor` elements: its share of N and its bytes read and written."""

    def __init__(self, floor: int):
        super().__init__()
        self.floor, self.passes, self.bytes = floor, Fraction(0), 0

    def _large(self, tensors) -> list[torch.Tensor]:
        return [t for t in tensors if isinstance(t, torch.Tensor) and t.numel() >= self.floor]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.inside or func.is_view or func.namespace != "aten" or name.startswith("empty"):
            return out
        inputs = tree_flatten((args, kwargs or {}))[0]
        if name in NOT_READ:
            inputs = inputs[1:]
        read, written = self._large(inputs), self._large(tree_flatten(out)[0])
        if read or written:
            largest = max(t.numel() for t in read + written)
            self.passes += Fraction(round(largest * WORLD / N), WORLD)  # a chunk's pass: 1/N
            self.bytes += sum(t.numel() * t.element_size() for t in read + written)
        return out


def _count(comm: Communicator, call) -> tuple[str, int]:
    counter = PassCounter(N // (2 * WORLD))
    run = comm._run
    comm._run = counter.pause(run)
    try:
        with counter:
            call()
    finally:
        comm._run = run
    return str(counter.passes), counter.bytes


def _counted(rank: int, world: int, out_dir, *_):
    import torch.distributed as dist

    comm = Communicator("dp", dist.group.WORLD, CommLog())
    found = {}
    for fmt in ("bf16", "int8", "fp8"):
        for feedback in (False, True) if fmt != "bf16" else (False,):
            wire = LowPrecisionCollectives(comm, fmt, feedback)
            x = torch.randn(N)
            wire.all_reduce(x, tag="t")  # the first call: no residual yet
            found[f"all_reduce/{fmt}/{feedback}"] = _count(comm, partial(wire.all_reduce, x, tag="t"))
        wire = LowPrecisionCollectives(comm, fmt)
        full, shard = torch.randn(N), torch.empty(N // world)
        found[f"reduce_scatter/{fmt}"] = _count(comm, partial(wire.reduce_scatter, shard, full, tag="rs"))
        output, mine = torch.empty(N), torch.randn(N // world)
        found[f"all_gather/{fmt}"] = _count(comm, partial(wire.all_gather_into, output, mine, tag="ag"))
    found.update(_outer_steps(comm))
    write_result(out_dir, rank, found)


def _outer_steps(comm: Communicator) -> dict:
    """DiLoCo's outer step over a small GPT, with and without momentum: its bytes over every parameter
    (each parameter is its own tensor here, so every tensor counts, however small)."""
    from parallel.core.model import GPT, GPTConfig
    from parallel.diloco.options import DiLoCoOptions
    from parallel.diloco.strategy import DiLoCo
    from parallel.strategy import make_optimizer

    found = {}
    for momentum in (0.9, 0.0):
        model = GPT(GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2), seed=0)
        options = DiLoCoOptions(inner_steps=2, outer_lr=0.7, outer_momentum=momentum, fragments=1)
        strategy = DiLoCo(model, make_optimizer(model, 1e-3, 0.1, "sgd"), comm, options)
        counter = PassCounter(1)
        run, comm._run = comm._run, counter.pause(comm._run)
        with counter:
            strategy.outer_step(0)
        comm._run = run
        found[f"outer_step/{momentum > 0}"] = [sum(p.numel() for p in model.parameters()), counter.bytes]
    return found


@pytest.fixture(scope="module")
def counted() -> dict:
    return run_ranks(WORLD, _counted)[0]


def _table(key: str) -> list:
    op, fmt, *feedback = key.split("/")
    if op == "all_reduce":
        return codec.all_reduce_passes(fmt, WORLD, feedback == ["True"])
    return codec.reduce_scatter_passes(fmt, WORLD) if op == "reduce_scatter" else codec.all_gather_passes(fmt, WORLD)


def test_every_collectives_passes_are_the_planners(counted):
    assert len(counted) == 13
    for key, (passes, nbytes) in counted.items():
        if key.startswith("outer_step"):
            continue
        table = _table(key)
        assert Fraction(passes) == codec.pass_count(table), key
        # Packed chunks carry their scales too: at most 4 bytes per 256 elements more per pass.
        assert nbytes == pytest.approx(float(codec.bytes_per_element(table)) * N, rel=0.02), key


def test_diloco_outer_step_moves_the_planners_bytes(counted):
    for momentum in (True, False):
        parameters, nbytes = counted[f"outer_step/{momentum}"]
        assert nbytes == codec.bytes_per_element(codec.outer_step_passes(momentum)) * parameters, momentum
