"""Run under torchrun by test_zero.py: the checkpoint interface of the sharded strategies.

For zero1, zero2, zero3 and PyTorch's torch_zero1, torch_zero2, torch_fsdp2 (tiny model, 2
microbatches): train 2 steps; the gathered
`full_state_dict()` and `full_optimizer_state()` must equal a single-process model and AdamW
trained on the same global batches; a fresh strategy given them by `load_full_state` must then
take the next step bitwise equal to the original (torch_zero1 within 1e-6: DDP rebuilds its buckets
in gradient-ready order after its first step, so the fresh DDP's first all-reduce sums each element
at another place of another bucket, rounding differently). Prints one line per strategy; exits non-zero
(an AssertionError) on the first difference.
"""

import sys
from pathlib import Path

import torch

# Run as a script: this checkout's code first (not an installed copy), bench's harness with it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from options import option  # noqa: E402

from bench.harness import plan_for, run_distributed  # noqa: E402
from parallel.baselines.fsdp2 import TorchFSDP2, TorchZero2  # noqa: E402
from parallel.baselines.zero_redundancy import TorchZero1  # noqa: E402
from parallel.core.data import GlobalBatches, local_microbatches  # noqa: E402
from parallel.core.model import GPT, token_loss_sum  # noqa: E402
from parallel.dist.groups import LaunchEnv  # noqa: E402
from parallel.strategy import make_optimizer  # noqa: E402
from parallel.zero.strategy import ZeroDataParallel  # noqa: E402
from parallel.zero.zero3 import Zero3  # noqa: E402

MICROBATCHES = 2


def check(plan, ctx, corpus) -> None:
    dp = ctx.comm("dp")
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)

    def local(step):
        g = batches(step)
        return ([mb.to(ctx.device) for mb in local_microbatches(g, ctx.coords["dp"], plan.dims.dp, MICROBATCHES)],
                g.n_tokens)

    reference = GPT(plan.model, seed=plan.seed)
    optimizer = make_optimizer(reference, plan.lr, plan.weight_decay)
    for step in range(2):
        g = batches(step)
        optimizer.zero_grad()
        (token_loss_sum(reference(g.inputs), g.targets) / g.n_tokens).backward()
        optimizer.step()

    def model():
        return GPT(plan.model, seed=plan.seed)

    makers = {
        "zero1": lambda: ZeroDataParallel(model(), dp, 1, plan.lr, plan.weight_decay),
        "zero2": lambda: ZeroDataParallel(model(), dp, 2, plan.lr, plan.weight_decay),
        "zero3": lambda: Zero3(model(), dp, plan.lr, plan.weight_decay),
        "torch_fsdp2": lambda: TorchFSDP2(model(), ctx.mesh["dp"], dp, plan.lr, plan.weight_decay),
        "torch_zero1": lambda: TorchZero1(model(), dp, option(plan, "bucket_mb"), plan.lr, plan.weight_decay),
        "torch_zero2": lambda: TorchZero2(model(), ctx.mesh["dp"], dp, plan.lr, plan.weight_decay),
    }
    lr = plan.lr
    for name, make in makers.items():
        original = make()
        for step in range(2):
            original.train_step(*local(step))
        params, optim = original.full_state_dict(), original.full_optimizer_state()
        assert optim["step"] == 2
        assert params.keys() == optim["state"].keys() == dict(reference.named_parameters()).keys()
        for n, p in reference.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-2 * lr,
                                       msg=lambda m, name=name, n=n: f"{name} {n}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(optim["state"][n][key], optimizer.state[p][key], rtol=1e-4, atol=1e-7,
                                           msg=lambda m, name=name, n=n, key=key: f"{name} {n} {key}: {m}")
        resumed = make()
        resumed.load_full_state(params, optim)
        batch = local(2)
        assert torch.equal(original.train_step(*batch), resumed.train_step(*batch)), name
        after, after_resumed = original.full_state_dict(), resumed.full_state_dict()
        if name == "torch_zero1":
            for n in after:
                torch.testing.assert_close(after_resumed[n], after[n], rtol=1e-6, atol=1e-8)
        else:
            assert all(torch.equal(after[n], after_resumed[n]) for n in after), name
        original.close()
        resumed.close()
        if ctx.is_rank0:
            print(f"{name}: checkpoint round trip ok", flush=True)


if __name__ == "__main__":
    env = LaunchEnv.from_environ()
    plan = plan_for(env, ["model=tiny", "parallel=zero1", "data.max_bytes=1000000",
                          f"parallel.microbatches={MICROBATCHES}", "train.global_batch=12"], [])
    run_distributed(env, plan, check)
