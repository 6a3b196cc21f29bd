"""Run under torchrun at world 4 (dp 1 x tp 2 x pp 2) by tests/runs/test_combined.py: the 3d strategy's
checkpoint interface against one process training the same model on the same data.

1. Two steps of parallel=3d, then `full_state_dict()` and `full_optimizer_state()` (gathered over
   tp and the stages): on rank 0 they must equal the parameters and AdamW moments of the single
   process after the same two steps.
2. A fresh 3d strategy built from another seed takes the whole dicts with `load_full_state()`
   (each rank keeps its piece, no collective) and gathers back exactly the same dicts; a third
   step from there matches the single process's third step.
Exit 0 when everything holds; an assertion (non-zero exit, torchrun stops the others) otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script: the project root must come first on the path (this checkout's code, not an installed one).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from types import SimpleNamespace

import torch

from parallel.compose.combined import build_combined
from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.model import GPT, GPTConfig
from parallel.dist.comm import CommLog
from parallel.dist.dims import ParallelDims
from parallel.dist.groups import LaunchEnv, exit_process, init_distributed, shutdown
from parallel.pp.executor import PipelineParallel
from parallel.registry import layout_of
from parallel.strategy import SingleProcess, make_optimizer

CFG = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)
SEED, GLOBAL_BATCH, MICROBATCHES, LR, WD = 1234, 16, 2, 1e-3, 0.1  # as the launcher's TINY runs


# rtol 1e-5 as everywhere; an atol for entries whose true value is (nearly) zero, where only the
# summation order differs: the gradients' 1e-6 of test_tp.py, through AdamW's moments (exp_avg is
# 0.1·g per step, exp_avg_sq 0.05·g²), and for the parameters 1% of one lr step (launcher.py).
ATOL = {"params": 1e-2 * LR, "exp_avg": 1e-7, "exp_avg_sq": 1e-10}


def close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=ATOL[what],
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def step(strategy, batches: GlobalBatches, k: int) -> None:
    batch = batches(k)
    strategy.train_step(local_microbatches(batch, 0, 1, MICROBATCHES), batch.n_tokens)


def ref_state(ref: SingleProcess) -> tuple[dict, dict]:
    """The single process's parameters and AdamW moments by name."""
    named = dict(ref.model.named_parameters())
    moments = {n: {k: ref.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")} for n, p in named.items()}
    return {n: p.detach() for n, p in named.items()}, moments


def check_gathered(params: dict, optim: dict, ref: SingleProcess) -> None:
    """1. The gathered dicts after two steps are the single process's (rank 0)."""
    ref_params, ref_moments = ref_state(ref)
    assert optim["step"] == 2 == ref.optimizer.step_count
    close(params, ref_params, "params")
    for k in ("exp_avg", "exp_avg_sq"):
        close({n: s[k] for n, s in optim["state"].items()}, {n: s[k] for n, s in ref_moments.items()}, k)


def check_reloaded(again: dict, again_optim: dict, params: dict, optim: dict) -> None:
    """2. What a strategy that loaded the dicts gathers back is exactly the dicts (rank 0)."""
    assert again_optim["step"] == 2
    assert all(torch.equal(again[n], params[n]) for n in params)
    for n, s in optim["state"].items():
        assert all(torch.equal(again_optim["state"][n][k], s[k]) for k in s), n


def main() -> None:
    env = LaunchEnv.from_environ()
    torch.set_num_threads(1)
    dims = ParallelDims.resolve(env.world_size, dp=1, tp=2, pp=2)
    corpus = load_corpus(None, 1_000_000, CFG.seq_len + 1)
    batches = GlobalBatches(corpus, CFG.seq_len, GLOBAL_BATCH, SEED)
    ctx = init_distributed(env, dims, "gloo", 60.0, CommLog())

    layout = layout_of(dims, microbatches=MICROBATCHES, grad_sync="naive")
    plan = SimpleNamespace(layout=layout, microbatches=MICROBATCHES, lr=LR, weight_decay=WD, backend=ctx.backend)

    def build(seed: int) -> PipelineParallel:
        return build_combined(GPT(CFG, seed=seed), plan, ctx)

    ref = None
    if ctx.is_rank0:
        model = GPT(CFG, seed=SEED)
        ref = SingleProcess(model, make_optimizer(model, LR, WD))

    strategy = build(SEED)
    for k in range(2):
        step(strategy, batches, k)
        if ref is not None:
            step(ref, batches, k)
    params, optim = strategy.full_state_dict(), strategy.full_optimizer_state()
    if ctx.is_rank0:
        check_gathered(params, optim, ref)

    # Every rank gets the whole dicts (here from rank 0, as a checkpoint reader would give them).
    world = ctx.comm("world")
    params, optim = world.broadcast_object((params, optim) if ctx.is_rank0 else None, 0, tag="tooling/test")
    restored = build(SEED + 1)
    restored.load_full_state(params, optim)
    again, again_optim = restored.full_state_dict(), restored.full_optimizer_state()
    if ctx.is_rank0:
        check_reloaded(again, again_optim, params, optim)
    step(restored, batches, 2)
    final = restored.full_state_dict()
    if ctx.is_rank0:
        step(ref, batches, 2)
        close(final, ref_state(ref)[0], "params")
        print("combined state check: ok", flush=True)
    restored.close()
    strategy.close()
    shutdown(ctx)
    exit_process(0)


if __name__ == "__main__":
    main()
