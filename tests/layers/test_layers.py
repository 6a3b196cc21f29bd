"""The building blocks, layer by layer, against their single-process twins, on real gloo ranks.

One spawn of 4 processes (tests/helpers/spawn.py) runs every check over tp (or dp) groups of 2 and 4:

* ColumnParallelLinear and RowParallelLinear inside a region (f ... g) against nn.Linear;
* the vocab-parallel cross-entropy against F.cross_entropy;
* the sequence-parallel regions (gather in, reduce-scatter out) with a LayerNorm in front, and with
  three column-parallel linears on one input that save its sequence piece (parallel.tp_saves=sharded):
  one all-gather again in backward for all three, the tensors saved for backward the piece, not the input;
* ZeroOptimizer stages 1 and 2 and the bucketed and naive dp syncs against AdamW on the summed
  gradient; ZeRO-2 naming a part that a backward left out.

Each check returns the largest difference it saw (forward output, input gradient, parameter
gradient or parameters after a step); the tests assert on them. End-to-end runs under torchrun
(test_tp.py, test_zero.py, ...) prove the same pieces inside whole training steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks, write_result

from parallel.core.optim import AdamW
from parallel.dist.comm import CommLog, Communicator
from parallel.sync.allreduce import BucketedGradSync, NaiveGradSync
from parallel.sync.zero import ZeroOptimizer
from parallel.tp.layers import ColumnParallelLinear, NormIntoTP, RowParallelLinear
from parallel.tp.loss import vocab_parallel_loss_sum
from parallel.tp.regions import SEQ_DIM

B, S, H, F_ = 2, 8, 16, 32  # batch, sequence, hidden, MLP width
VOCAB = 64


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to the reference's largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rows(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def check_region_linears(comm: Communicator, sequence_parallel: bool) -> dict:
    """x -> LayerNorm -> f -> column (h -> f) -> GELU -> row (f -> h) -> g, against the same in one process."""
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(B, S, H, generator=gen)
    norm, fc, proj = nn.LayerNorm(H), nn.Linear(H, F_), nn.Linear(F_, H)
    for p in (*fc.parameters(), *proj.parameters(), *norm.parameters()):
        p.data.normal_(0, 0.5, generator=gen)
    tp_norm = copy.deepcopy(norm)  # NormIntoTP shares its norm's parameters: give it its own
    # The reference, one process.
    x_ref = x_full.clone().requires_grad_(True)
    ref = proj(F.gelu(fc(norm(x_ref))))
    ref.pow(2).sum().backward()
    # The tp version: rank r holds columns/rows r of the linears; under SP its piece of the sequence.
    t, r = comm.size, comm.rank
    x = (_rows(x_full, r, t, SEQ_DIM) if sequence_parallel else x_full).clone().requires_grad_(True)
    enter = NormIntoTP(tp_norm, comm, "tp/test", sequence_parallel)
    col = ColumnParallelLinear.from_full(fc, comm)
    row = RowParallelLinear.from_full(proj, comm, "tp/test", sequence_parallel)
    y = row(F.gelu(col(enter(x))))
    y.pow(2).sum().backward()
    want_y = _rows(ref, r, t, SEQ_DIM) if sequence_parallel else ref
    want_dx = _rows(x_ref.grad, r, t, SEQ_DIM) if sequence_parallel else x_ref.grad
    result = {
        "output": _max(y, want_y.detach()),
        "input_grad": _max(x.grad, want_dx),
        "column_weight_grad": _max(col.weight.grad, _rows(fc.weight.grad, r, t)),
        "row_weight_grad": _max(row.weight.grad, _rows(proj.weight.grad, r, t, dim=1)),
    }
    # Under SP the norm's and the row bias's gradients are partial: summed over tp they are whole.
    for name, got, want in (("norm_weight_grad", enter.weight.grad, norm.weight.grad),
                            ("row_bias_grad", row.bias.grad, proj.bias.grad)):
        if sequence_parallel:
            got = got.clone()
            comm.all_reduce(got, tag="tooling/test")
        result[name] = _max(got, want)
    return result


def check_sharded_saving(comm: Communicator, log: CommLog) -> dict:
    """x -> LayerNorm -> gather -> three column linears (Q, K and V share one input) -> their GELUs
    summed -> row -> reduce-scatter, the linears saving the sequence piece: against one process, and
    the differences as numbers: the regathers in backward (one, not three) and the gathered input
    saved by nothing."""
    gen = torch.Generator().manual_seed(4)
    x_full = torch.randn(B, S, H, generator=gen)
    norm, proj = nn.LayerNorm(H), nn.Linear(F_, H)
    fcs = [nn.Linear(H, F_) for _ in range(3)]
    for p in (*proj.parameters(), *norm.parameters(), *(q for fc in fcs for q in fc.parameters())):
        p.data.normal_(0, 0.5, generator=gen)
    x_ref = x_full.clone().requires_grad_(True)
    hidden = norm(x_ref)
    ref = proj(sum(F.gelu(fc(hidden)) for fc in fcs))
    ref.pow(2).sum().backward()
    t, r = comm.size, comm.rank
    x = _rows(x_full, r, t, SEQ_DIM).clone().requires_grad_(True)
    enter = NormIntoTP(copy.deepcopy(norm), comm, "tp/sharded", sequence_parallel=True, saves_shard=True)
    cols = [ColumnParallelLinear.from_full(fc, comm) for fc in fcs]
    row = RowParallelLinear.from_full(proj, comm, "tp/sharded", sequence_parallel=True)
    saved = []  # the storages autograd keeps of the region

    def pack(tensor):
        saved.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        entered = enter(x)
        y = row(sum(F.gelu(col(entered)) for col in cols))
    piece = entered.sequence_piece.piece.untyped_storage().data_ptr()  # the norm's output on this rank's piece
    key = ("all_gather", "tp", "tp/sharded/regather")
    before = log.outside[key].calls
    y.pow(2).sum().backward()
    result = {
        "output": _max(y, _rows(ref, r, t, SEQ_DIM).detach()),
        "input_grad": _max(x.grad, _rows(x_ref.grad, r, t, SEQ_DIM)),
        # Differences that are counts: 0 when right.
        "regathers_in_backward_minus_one": float(abs(log.outside[key].calls - before - 1)),
        "gathered_inputs_saved": float(saved.count(entered.untyped_storage().data_ptr())),
    }
    for i, (col, fc) in enumerate(zip(cols, fcs)):
        result[f"column{i}_weight_grad"] = _max(col.weight.grad, _rows(fc.weight.grad, r, t))
        result[f"column{i}_bias_grad"] = _max(col.bias.grad, _rows(fc.bias.grad, r, t))
    got = enter.weight.grad.clone()
    comm.all_reduce(got, tag="tooling/test")  # partial under SP: summed over tp it is whole
    result["norm_weight_grad"] = _max(got, norm.weight.grad)
    result["piece_saves_minus_three"] = float(abs(saved.count(piece) - 3))  # once by each column linear
    return result


def check_vocab_parallel_loss(comm: Communicator) -> dict:
    gen = torch.Generator().manual_seed(1)
    logits_full = torch.randn(B, S, VOCAB, generator=gen) * 3
    targets = torch.randint(0, VOCAB, (B, S), generator=gen)
    ref_logits = logits_full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    ref.backward()
    t, r = comm.size, comm.rank
    local = _rows(logits_full, r, t, dim=2).clone().requires_grad_(True)
    loss = vocab_parallel_loss_sum(local, targets, r * VOCAB // t, comm)
    loss.backward()
    return {"loss": abs(float(loss) - float(ref)) / float(ref),
            "logits_grad": _max(local.grad, _rows(ref_logits.grad, r, t, 2))}


def check_dp_syncs(comm: Communicator) -> dict:
    """Naive and bucketed syncs give every rank the sum of all ranks' gradients."""
    result = {}
    for kind in ("naive", "bucketed"):
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(H, F_), nn.Linear(F_, H))
        plain = nn.Sequential(nn.Linear(H, F_), nn.Linear(F_, H))
        plain.load_state_dict(model.state_dict())
        named = list(model.named_parameters())
        # A 1 KiB bucket cap: several buckets, each all-reduced from a hook while backward goes on.
        sync = NaiveGradSync(named, comm) if kind == "naive" else BucketedGradSync([p for _, p in named], comm, 1024)
        sync.zero_grad()
        sync.before_microbatch(True)
        x = torch.randn(B, H, generator=torch.Generator().manual_seed(10 + comm.rank))
        model(x).pow(2).sum().backward()
        sync.finish()
        plain(x).pow(2).sum().backward()  # this rank's own gradient, with no sync in the way
        worst = 0.0
        for (_, p), q in zip(named, plain.parameters()):
            total = q.grad.clone()
            comm.all_reduce(total, tag="tooling/test")  # the sum, computed another way
            worst = max(worst, _max(p.grad, total))
        result[kind] = worst
    return result


def check_zero_optimizer(comm: Communicator, stage: int) -> dict:
    """ZeroOptimizer over dp: after a step every rank holds what AdamW on the summed gradient gives."""
    gen = torch.Generator().manual_seed(3)
    reference = nn.Sequential(nn.Linear(H, F_), nn.LayerNorm(F_), nn.Linear(F_, 7))  # 7: sizes that pad
    sharded = nn.Sequential(nn.Linear(H, F_), nn.LayerNorm(F_), nn.Linear(F_, 7))
    sharded.load_state_dict(reference.state_dict())
    # Parts as the GPT's are named: one part per module here.
    named = [(f"blocks.{n}", p) for n, p in sharded.named_parameters()]
    zero = ZeroOptimizer(named, comm, stage, lr=1e-2, weight_decay=0.1)
    adamw = AdamW([{"params": [p for p in reference.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                   {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    worst = 0.0
    for _step in range(3):
        xs = [torch.randn(B, H, generator=gen) for _ in range(comm.size)]  # every rank draws all ranks' data
        zero.zero_grad()
        zero.before_microbatch(True)
        sharded(xs[comm.rank]).pow(2).sum().backward()
        zero.finish()
        zero.step()
        adamw.zero_grad()
        sum(reference(x).pow(2).sum() for x in xs).backward()
        adamw.step()
        worst = max(worst, max(_max(a, b) for a, b in zip(sharded.parameters(), reference.parameters())))
    return {"params_after_3_steps": worst}


def check_zero2_names_a_part_left_out(comm: Communicator) -> dict:
    """A part whose parameters a backward left out is never reduced: ZeRO-2's finish names it (a
    part reduced fewer times than the others would otherwise leave its shard short a microbatch)."""
    model = nn.Sequential(nn.Linear(H, F_), nn.LayerNorm(F_), nn.Linear(F_, 7))
    zero = ZeroOptimizer([(f"blocks.{n}", p) for n, p in model.named_parameters()], comm, 2, lr=1e-2,
                         weight_decay=0.0)
    zero.zero_grad()
    zero.before_microbatch(True)
    model[1](model[0](torch.randn(B, H))).pow(2).sum().backward()  # blocks.2 takes no part
    try:
        zero.finish()
    except RuntimeError as e:
        return {"names_the_part": 0.0 if "['blocks.2']" in str(e) else 1.0}
    return {"names_the_part": 1.0}


def worker(rank: int, world: int, out_dir) -> None:
    log = CommLog()
    groups = {f"pair{k}": dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)}
    pair = Communicator("tp", groups[f"pair{rank // 2}"], log)
    four = Communicator("tp", dist.group.WORLD, log)
    result = {}
    for size, comm in (("2", pair), ("4", four)):
        result[f"linears_tp{size}"] = check_region_linears(comm, sequence_parallel=False)
        result[f"linears_sp{size}"] = check_region_linears(comm, sequence_parallel=True)
        result[f"sharded_saving{size}"] = check_sharded_saving(comm, log)
        result[f"loss_tp{size}"] = check_vocab_parallel_loss(comm)
        result[f"dp_syncs{size}"] = check_dp_syncs(comm)
        for stage in (1, 2):
            result[f"zero{stage}_dp{size}"] = check_zero_optimizer(comm, stage)
        result[f"zero2_left_out{size}"] = check_zero2_names_a_part_left_out(comm)
    write_result(out_dir, rank, result)


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, worker)


CHECKS = [f"{what}{size}" for size in ("2", "4") for what in ("linears_tp", "linears_sp", "sharded_saving", "loss_tp",
                                                               "dp_syncs", "zero1_dp", "zero2_dp", "zero2_left_out")]


@pytest.mark.parametrize("check", CHECKS)
def test_layer_equals_its_single_process_twin(results, check):
    # fp32 rounding of a different summation order only: 1e-5 of the reference's largest magnitude.
    failures = [f"rank {rank} {what}: {diff:.3g}" for rank, result in enumerate(results)
                for what, diff in result[check].items() if not diff < 1e-5]
    assert not failures, f"{check}: {failures}"
