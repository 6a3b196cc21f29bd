"""In-process checks of the reliability layer: option validation, the non-finite guard, and the
checkpoint files (atomic publish, `latest`, resume checks). Fast: no process groups, no torchrun."""

import json

import pytest
import torch
from test_layout import plan_for

from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.model import GPT, GPTConfig
from parallel.dist.dims import LayoutError
from parallel.reliability.checkpoint import (
    CheckpointError,
    checkpoint_meta,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from parallel.run_plan import ConfigError
from parallel.strategy import NonFiniteLoss, SingleProcess, make_optimizer

TINY = ["model=tiny", "train.steps=6", "train.warmup_steps=1"]


@pytest.mark.parametrize("world,overrides,message", [
    (1, ["train.lr=abc"], r"train.lr='abc' must be a positive number: e.g. train.lr=0.001"),
    (1, ["train.lr=0"], r"train.lr=0 must be a positive number"),
    (2, ["parallel.bucket_mb=big"], r"parallel.bucket_mb='big' must be a positive number"),
    (2, ["parallel.timeout_s=-5"], r"parallel.timeout_s=-5 must be a positive number"),
    (1, ["train.weight_decay=-0.1"], r"train.weight_decay=-0.1 must be a number >= 0"),
    (1, ["train.seed=-1"], r"train.seed=-1 must be an integer >= 0"),
    (1, ["data.max_bytes=0"], r"data.max_bytes=0 must be an integer >= 1"),
    (1, ["train.threads=0"], r"train.threads=0 must be a positive integer, or null"),
    (1, ["train.host_allocator=jemalloc"], r"train.host_allocator='jemalloc': choose one of keep, system"),
    (2, ["train.gloo_loop_policy=idle"], r"train.gloo_loop_policy='idle': choose one of batch, normal"),
    (2, ["train.pin_cores=always"], r"train.pin_cores='always': choose one of auto, off"),
    (2, ["parallel=pp_1f1b", "parallel.virtual_stages=x"], r"parallel.virtual_stages='x' must be an integer >= 1"),
    (1, ["train.checkpoint_every=-1"], r"train.checkpoint_every=-1 must be an integer >= 0"),
    (1, ["train.check_finite=maybe"], r"train.check_finite='maybe' must be true or false"),
    (1, ["train.checkpoint_async=1"], r"train.checkpoint_async=1 must be true or false"),
    (1, ["train.checkpoint_sharded=yes"], r"train.checkpoint_sharded='yes' must be true or false"),
    (2, ["parallel=tp", "parallel.sequence_parallel=yes"], r"parallel.sequence_parallel='yes' must be true or false"),
    (1, ["model.vocab_size=100"], r"model.vocab_size=100 is below 256, but the data is byte-level"),
    (1, ["model.n_layers=0"], r"model.n_layers=0 must be a positive integer"),
    (1, ["train.steps=0"], r"train.steps=0 must be a positive integer"),
    # The fault-injection testing aid
    (1, ["train.fail_mode=boom", "train.fail_at_step=1"], r"train.fail_mode='boom': choose one of raise, exit, hang"),
    (1, ["train.fail_mode=raise", "train.fail_at_step=6"],
     r"train.fail_at_step=6 must be a step this run reaches, 0 to 5"),
    (2, ["train.fail_mode=raise", "train.fail_at_step=1", "train.fail_rank=2"],
     r"train.fail_rank=2 must be a rank of this run, 0 to 1"),
    (2, ["train.fail_mode=kill_during_save", "train.fail_at_step=2", "train.checkpoint_every=2", "train.fail_rank=1"],
     r"kill_during_save kills the checkpoint writer, which is rank 0"),
    (1, ["train.fail_mode=kill_during_save", "train.fail_at_step=3", "train.checkpoint_every=2"],
     r"no checkpoint is saved after 3 steps \(train.checkpoint_every=2\)"),
    (1, ["train.resume=/no/such/checkpoint"], r"train.resume='/no/such/checkpoint' does not exist"),
])
def test_plan_refuses_bad_option(world, overrides, message):
    with pytest.raises((ConfigError, LayoutError, CheckpointError), match=message):
        plan_for(world, *TINY, *overrides)


# -- non-finite loss -----------------------------------------------------------------------------
def _single(lr: float):
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)
    model = GPT(cfg, seed=0)
    corpus = load_corpus(None, 100_000, 17)
    batches = GlobalBatches(corpus, 16, 4, seed=0)
    return SingleProcess(model, make_optimizer(model, lr, 0.1)), batches


def _snapshot(strategy):
    return ({n: p.detach().clone() for n, p in strategy.model.named_parameters()},
            strategy.optimizer.step_count,
            {n: {k: v.clone() for k, v in s.items()} for n, s in strategy.full_optimizer_state()["state"].items()})


def _same(a, b) -> bool:
    """Bitwise equal, NaN where the other has NaN (the poisoned weight stays what it was)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _assert_unchanged(before, strategy):
    params, step, moments = before
    assert strategy.optimizer.step_count == step
    for n, p in strategy.model.named_parameters():
        assert _same(p.detach(), params[n]), n
    for n, s in strategy.full_optimizer_state()["state"].items():
        assert all(_same(v, moments[n][k]) for k, v in s.items()), n


def test_nan_weight_stops_the_step_before_the_optimizer():
    strategy, batches = _single(lr=1e-3)
    batch = batches(0)
    strategy.train_step(local_microbatches(batch, 0, 1, 1), batch.n_tokens)  # one good step: moments exist
    with torch.no_grad():
        strategy.model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    before = _snapshot(strategy)
    with pytest.raises(NonFiniteLoss, match="this rank's share of the loss is nan"):
        strategy.train_step(local_microbatches(batches(1), 0, 1, 1), batch.n_tokens)
    _assert_unchanged(before, strategy)


def test_exploding_learning_rate_is_caught_at_the_first_non_finite_loss():
    strategy, batches = _single(lr=1e30)
    before = None
    with pytest.raises(NonFiniteLoss):
        for step in range(10):
            before = _snapshot(strategy)
            batch = batches(step)
            strategy.train_step(local_microbatches(batch, 0, 1, 1), batch.n_tokens)
    assert step >= 1  # the first step's loss is finite: the weights blow up after it
    _assert_unchanged(before, strategy)


# -- checkpoint files ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    """A tiny single-process model after two steps, and the plan of a tiny run."""
    strategy, batches = _single(lr=1e-3)
    for step in range(2):
        batch = batches(step)
        strategy.train_step(local_microbatches(batch, 0, 1, 1), batch.n_tokens)
    return strategy


def _save(root, strategy, step, plan=None):
    plan = plan or plan_for(1, *TINY)
    return save_checkpoint(root, step, strategy.full_state_dict(), strategy.full_optimizer_state(),
                           checkpoint_meta(plan, step))


def test_checkpoint_round_trip_and_latest(trained, tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, trained, 1)
    path = _save(root, trained, 2)
    (root / "step_000009.tmp-123").mkdir()  # an interrupted save: never a candidate
    assert resolve_checkpoint(str(root)) == path == resolve_checkpoint(str(path))
    (root / "latest").unlink()  # without the marker: the highest complete step directory
    assert resolve_checkpoint(str(root)) == path
    model_state, optim_state = load_checkpoint(path)
    assert optim_state["step"] == 2
    fresh, _ = _single(lr=1e-3)
    fresh.load_full_state(model_state, optim_state)
    for (n, p), (_, q) in zip(fresh.model.named_parameters(), trained.model.named_parameters()):
        assert torch.equal(p, q), n
    want = trained.full_optimizer_state()
    got = fresh.full_optimizer_state()
    assert got["step"] == want["step"] and got["state"].keys() == want["state"].keys()
    for n in want["state"]:
        assert all(torch.equal(got["state"][n][k], want["state"][n][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_resume_refuses_what_cannot_continue(trained, tmp_path):
    root = tmp_path / "checkpoints"
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint .* unfinished \*.tmp-\* ones are ignored"):
        plan_for(1, *TINY, f"train.resume={tmp_path / 'empty'}")
    with pytest.raises(CheckpointError, match=r"is a file, not a checkpoint directory"):
        plan_for(1, *TINY, f"train.resume={tmp_path / 'file'}")
    path = _save(root, trained, 3)
    plan = plan_for(1, *TINY, f"train.resume={root}", "parallel.timeout_s=5")
    assert (plan.resume_from, plan.start_step) == (str(path), 3)
    with pytest.raises(CheckpointError, match=r"holds a different model: model.n_layers=2 \(checkpoint: 4\)"):
        plan_for(1, *TINY, f"train.resume={root}", "model.n_layers=2")
    with pytest.raises(CheckpointError,
                       match=r"other data: train.global_batch=8 \(checkpoint: 16\), train.seed=7 \(checkpoint: 1234\)|"
                             r"other data: train.seed=7 \(checkpoint: 1234\), train.global_batch=8 \(checkpoint: 16\)"):
        plan_for(1, *TINY, f"train.resume={root}", "train.global_batch=8", "train.seed=7")
    with pytest.raises(CheckpointError, match=r"continues at step 3, and train.steps=4 .* raise train.steps above 4"):
        plan_for(1, *TINY, f"train.resume={root}", "train.steps=4", "train.warmup_steps=1")
    meta = json.loads((path / "meta.json").read_text())
    assert meta["saved_by"]["strategy"] == "single" and meta["next_step"] == 3


# -- naming the failed peer ------------------------------------------------------------------------
def test_a_survivor_names_the_peer_that_exited():
    """A real child process that has exited (a zombie until reaped) is named; a live one is not."""
    import os
    import socket
    import subprocess
    import sys

    from parallel.dist.comm import CommFailure
    from parallel.reliability.faults import describe_failure, gone_peers

    host = socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        table = [(host, os.getpid()), (host, alive.pid), (host, dead.pid), ("another-host", 1)]
        # The short child exits and stays a zombie (nobody has waited for it), as a dead rank
        # does until torchrun collects it; gone_peers waits up to its wait_s for that.
        assert gone_peers(table, rank=0, wait_s=30) == [f"rank 2 (pid {dead.pid})"]
    finally:
        alive.kill()
        alive.wait()
        dead.wait()
    error = CommFailure("all_reduce 'grads/bucket0' over group dp (ranks [0, 1, 2]): Connection reset by peer")
    error.gone_peers = ["rank 2 (pid 7)"]
    assert describe_failure(error, 0, 60) == (
        "rank 0 stopped: rank 2 (pid 7) exited, so all_reduce 'grads/bucket0' over group dp (ranks [0, 1, 2]): "
        "Connection reset by peer")
    assert describe_failure(CommFailure("recv 'pp/fwd/0->1' over group pp (ranks [0, 1]) with rank 0: "
                                        "Timed out waiting 5000ms"), 1, 5) \
        .startswith("rank 1 stopped: recv 'pp/fwd/0->1' over group pp (ranks [0, 1]) with rank 0: "
                    "Timed out waiting 5000ms: waited parallel.timeout_s=5 s")
