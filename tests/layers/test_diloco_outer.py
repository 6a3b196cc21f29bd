"""DiLoCo's outer step with real gloo ranks, against torch.optim.SGD(nesterov=True) on the mean
pseudo-gradient computed here from every rank's drift, which each rank knows from the seeds.

One spawn of 2 ranks, fragments F = 2: each rank drifts its local parameters by noise of its own;
the outer step of fragment 1 alone must move fragment 1's outer parameters exactly as PyTorch's
Nesterov SGD moves a copy given the mean drift as its gradient (twice, so the momentum counts),
reset the local parameters of fragment 1 to them, and leave fragment 0's local drift untouched."""

import torch
import torch.distributed as dist
from spawn import run_ranks, write_result

from parallel.core.model import GPT, GPTConfig
from parallel.diloco.options import DiLoCoOptions
from parallel.diloco.strategy import DiLoCo
from parallel.dist.comm import CommLog, Communicator
from parallel.strategy import make_optimizer

CONFIG = GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)
OPTIONS = DiLoCoOptions(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, fragments=2)


def _drift(p: torch.Tensor, rank: int, index: int, sync: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * sync + 10 * index + rank)) * 1e-2


def _check(rank: int, world: int, out_dir) -> None:
    model = GPT(CONFIG, seed=0)
    comm = Communicator("dp", dist.group.WORLD, CommLog(enabled=False, timed=False))
    strategy = DiLoCo(model, make_optimizer(model, 1e-3, 0.1, "sgd"), comm, OPTIONS)
    params = list(model.parameters())
    fragment = {id(p) for p in strategy.fragments[1]}
    reference = [p.detach().clone().requires_grad_() for p in params]
    outer_sgd = torch.optim.SGD(reference, lr=OPTIONS.outer_lr, momentum=OPTIONS.outer_momentum, nesterov=True)
    errors, untouched = [], True
    for sync in range(2):
        with torch.no_grad():
            for i, p in enumerate(params):
                p.sub_(_drift(p, rank, i, sync))
        before = [p.detach().clone() for p in params]
        strategy.outer_step(1)
        outer_sgd.zero_grad()
        for i, (p, ref) in enumerate(zip(params, reference)):
            if id(p) in fragment:  # the mean of every rank's outer − local: its drift
                ref.grad = sum(_drift(p, r, i, sync) for r in range(world)) / world
        outer_sgd.step()
        for i, (p, ref) in enumerate(zip(params, reference)):
            if id(p) in fragment:
                errors.append(float((p - ref).abs().max()))
                errors.append(float((strategy.outer[p] - ref).abs().max()))
            else:
                untouched &= bool(torch.equal(p, before[i]))
    write_result(out_dir, rank, {"max_error": max(errors), "untouched": untouched,
                                 "fragment_share": sum(p.numel() for p in strategy.fragments[1])
                                 / sum(p.numel() for p in params)})


def test_the_outer_step_is_nesterov_sgd_on_the_mean_drift_of_one_fragment():
    for result in run_ranks(2, _check):
        assert result["max_error"] < 1e-6, result
        assert result["untouched"] is True
        assert 0 < result["fragment_share"] < 1
