"""DiLoCo's pieces that need no process group: the plain SGD's decay, the fragments and their schedule, the
closed forms against dp's, and every refusal, each one line naming the value, before any group."""

from fractions import Fraction

import pytest
import torch
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT

from parallel.algebra import parameter_count, part_parameter_counts
from parallel.core.model import GPT, GPTConfig, token_loss_sum
from parallel.diloco.schedule import fragment_parts, offset, syncing
from parallel.diloco.theory import diloco_comm, diloco_model_state_bytes, fragment_parameters
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.dp.theory import dp_comm, replicated_model_state_bytes
from parallel.registry import layout_of
from parallel.run_plan import ConfigError, build_plan
from parallel.strategy import make_optimizer

CFG = GPTConfig(seq_len=16, n_layers=3, d_model=32, n_heads=2)


def test_sgd_decays_as_the_adamw_does():
    """Decoupled decay on matrices only, as make_optimizer's AdamW (test_optim.py: the step equals torch's SGD)."""
    idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    model = GPT(CFG, seed=1)
    opt = make_optimizer(model, lr=1e-2, weight_decay=0.1, kind="sgd")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    token_loss_sum(model(idx), idx).backward()
    opt.step()
    for name, p in model.named_parameters():
        decay = 0.1 if p.dim() >= 2 else 0.0
        torch.testing.assert_close(p, before[name] * (1 - 1e-2 * decay) - 1e-2 * p.grad, rtol=0, atol=1e-7)
    assert opt.state_bytes() == 0 and opt.named_state(model.named_parameters()) == {"step": 1, "state": {}}


@pytest.mark.parametrize("h,f", [(1, 1), (3, 1), (3, 2), (5, 5), (10, 4)])
def test_every_h_steps_hold_one_sync_of_every_fragment(h, f):
    runs = fragment_parts(CFG.n_layers + 2, min(f, CFG.n_layers + 2))
    assert [i for run in runs for i in run] == list(range(CFG.n_layers + 2)) and all(runs)
    for start in range(1, 3 * h):
        window = [g for t in range(start, start + h) for g in syncing(t, h, f)]
        assert sorted(window) == list(range(f)), (start, window)
    assert [offset(g, h, f) for g in range(f)] == sorted({g * h // f for g in range(f)})


@pytest.mark.parametrize("f", [1, 2, 5])
def test_h_steps_of_diloco_send_one_step_of_dp(f):
    dims = ParallelDims.resolve(4)
    assert sum(fragment_parameters(CFG, f)) == parameter_count(CFG) == sum(part_parameter_counts(CFG))
    theory = diloco_comm(CFG, layout_of(dims, inner_steps=7, fragments=f))
    assert Fraction(theory["sent_bytes_per_step_exact"]) * 7 == Fraction(dp_comm(CFG, layout_of(dims))
                                                                          ["sent_bytes_per_step_exact"])
    per_sync = [Fraction(s["sent_bytes_exact"]) for s in theory["sent_bytes_per_fragment_sync"]]
    assert sum(per_sync) == Fraction(theory["sent_bytes_per_step_exact"]) * 7 and len(per_sync) == f
    # The outer copy (and the Nesterov buffer where μ > 0) on top of dp's model state: 4Ψ each.
    dp_state = replicated_model_state_bytes(CFG, layout_of(dims))["optimizer_bytes"]
    for mu, extra in ((0.0, 4), (0.9, 8)):
        state = diloco_model_state_bytes(CFG, layout_of(dims, outer_momentum=mu))["optimizer_bytes"]
        assert state == dp_state + extra * parameter_count(CFG)


def _plan(world: int, *overrides):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", *overrides])
    return build_plan(cfg, LaunchEnv(world_size=world, local_world_size=world), cuda_available=False)


@pytest.mark.parametrize("overrides,words", [
    (["parallel.inner_steps=0"], "parallel.inner_steps=0 must be an integer >= 1"),
    (["parallel.outer_lr=0"], "parallel.outer_lr=0 must be a positive number"),
    (["parallel.outer_momentum=1"], "parallel.outer_momentum=1 must be in [0, 1)"),
    (["parallel.fragments=0"], "parallel.fragments=0 must be an integer >= 1"),
    (["parallel.inner_steps=2", "parallel.fragments=3"], "parallel.fragments=3 is more than parallel.inner_steps=2"),
    (["parallel.inner_steps=50", "parallel.fragments=7"], "parallel.fragments=7 is more than the model's 6 parts"),
    (["parallel.tp=2"], "parallel=diloco is data parallel only, but parallel.tp=2"),
    (["parallel.zero=1"], "parallel.zero=1 sets the ZeRO stage"),
    (["train.checkpoint_every=2"], "parallel=diloco cannot save or load checkpoints"),
    (["train.optimizer=lion"], "train.optimizer='lion': choose one of adamw, sgd"),
])
def test_diloco_refusals_name_the_value_and_the_fix(overrides, words):
    with pytest.raises((ConfigError, LayoutError)) as e:
        _plan(4, "parallel=diloco", *overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_sgd_is_honoured_by_the_common_path_and_refused_by_zero():
    assert _plan(4, "parallel=diloco", "train.optimizer=sgd").optimizer == "sgd"
    assert _plan(4, "parallel=dp", "train.optimizer=sgd").optimizer == "sgd"
    assert _plan(1, "parallel=dp").optimizer == "adamw"
    with pytest.raises(ConfigError, match=r"train.optimizer=sgd: parallel=zero2 builds an AdamW of its own"):
        _plan(4, "parallel=dp", "parallel.zero=2", "train.optimizer=sgd")
