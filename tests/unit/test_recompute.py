"""Activation recomputation and the context-parallel plan, in one process (no ranks, no torchrun).

* The recompute transform (parallel/core/recompute.py) leaves the loss and every gradient as they were
  (measured: bit-identical; asserted within 1e-6), with dropout too (the random state is replayed),
  and the bytes the ActivationMeter measures equal activations.activation_terms exactly for
  none / selective / full, on three shapes (GPT-2's block twice, Llama's).
* The closed forms recomputation changes: tensor parallelism's 8 -> 12 units of b·s·h·(t−1)/t per
  layer under `full` (nothing more under `selective`), the ring's and the all-to-all's forward
  bytes counted twice; written out by hand here against parallel/cp/theory.py.
* The plan: each layout or model that context parallelism or recomputation cannot run is refused
  with its one line before any process group; the routes put cp with tp or pp on the one mesh.
"""

from fractions import Fraction

import pytest
import torch
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT
from options import option

from parallel import activations, algebra
from parallel.core.model import GPT, GPTConfig, token_loss_sum
from parallel.core.recompute import apply_recompute
from parallel.cp import theory as cp_theory
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.layout import Layout
from parallel.registry import expected_comm, layout_of
from parallel.report.activations import ActivationMeter
from parallel.run_plan import ConfigError, build_plan

MODES = ("none", "selective", "full")


def _step(cfg: GPTConfig, mode: str, b: int, global_batch: int, seed: int = 0):
    """One forward and backward of microbatch 0 (b sequences, views of a global batch as the data
    loader gives them): (loss, flat gradients, the meter's peak)."""
    torch.manual_seed(seed)  # dropout's masks, when there is dropout
    model = GPT(cfg, seed=1)
    model.train()
    apply_recompute(model, mode)
    windows = torch.randint(0, 256, (global_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(2))
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    meter = ActivationMeter(model.parameters())
    with meter.step():
        loss = token_loss_sum(model(inputs[:b]), targets[:b]) / (global_batch * cfg.seq_len)
        loss.backward()
    return loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()]), meter.peak


@pytest.mark.parametrize("cfg,b,global_batch", [
    (GPTConfig(seq_len=32, n_layers=2, d_model=64, n_heads=4), 2, 16),
    (GPTConfig(seq_len=48, n_layers=3, d_model=32, n_heads=2, mlp_ratio=2, vocab_size=300), 3, 6),
    # Llama's block (conf/model/tiny_llama.yaml): GQA, SwiGLU, RMSNorm, RoPE, no biases.
    (GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, gated_mlp=True,
               norm="rmsnorm", position_embedding="rope", bias=False), 4, 16),
])
def test_recomputation_keeps_the_numbers_and_saves_what_the_formula_says(cfg, b, global_batch):
    results = {mode: _step(cfg, mode, b, global_batch) for mode in MODES}
    loss, grads, _ = results["none"]
    for mode, (mode_loss, mode_grads, peak) in results.items():
        assert abs(mode_loss - loss) <= 1e-6 * abs(loss), mode
        torch.testing.assert_close(mode_grads, grads, rtol=1e-6, atol=0)
        layout = Layout(ParallelDims(world_size=1, dp=1), microbatch_size=b, microbatches=global_batch // b,
                        recompute=mode)
        assert peak == activations.activation_terms(cfg, layout)["peak"], mode
    peaks = [results[mode][2] for mode in MODES]
    assert peaks[0] > peaks[1] > peaks[2]


def test_recomputation_replays_dropout():
    cfg = GPTConfig(seq_len=32, n_layers=2, d_model=64, n_heads=4, dropout=0.1)
    loss, grads, _ = _step(cfg, "none", 2, 4, seed=7)
    for mode in ("selective", "full"):
        mode_loss, mode_grads, _ = _step(cfg, mode, 2, 4, seed=7)
        assert mode_loss == loss
        torch.testing.assert_close(mode_grads, grads, rtol=1e-6, atol=0)
    # Dropout is outside what the activation formula derives: no formula rather than a wrong one.
    assert activations.activation_terms(cfg, Layout(ParallelDims(world_size=1, dp=1))) is None


# -- the closed forms recomputation changes ----------------------------------------------------------
CFG = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)
S, H, L, A, D = 32, 64, 4, 4, 16


@pytest.mark.parametrize("sp", [False, True])
def test_full_recomputation_adds_half_again_to_tensor_parallel_activations(sp):
    t, b, m = 2, 4, 2
    dims = ParallelDims.resolve(t, tp=t)
    sent = {mode: Fraction(expected_comm("tp", CFG, dims, microbatch_size=b, microbatches=m, sequence_parallel=sp,
                                         recompute=mode)["sent_bytes_per_step_exact"]) for mode in MODES}
    unit = b * S * H * Fraction(t - 1, t) * 4 * t  # b·s·h·(t−1)/t fp32 bytes, every rank
    # Per layer and microbatch 8 units (2 forward + 2 backward all-reduces of 2(t−1)/t) become 12.
    assert sent["full"] - sent["none"] == L * m * (12 - 8) * unit
    assert sent["selective"] == sent["none"]


@pytest.mark.parametrize("cp", [2, 4])
def test_recomputation_sends_the_cp_forward_again(cp):
    b, m, d = 2, 2, 2
    dims = ParallelDims.resolve(d * cp, dp=d, cp=cp)
    u = b * A * (S // cp) * D  # one of a rank's Q, K, V
    grads = 2 * Fraction(d * cp - 1, d * cp) * algebra.parameter_count(CFG) * 4  # over dp x cp, per rank
    ring_fwd, ring_bwd = (cp - 1) * 2 * u * 4, (cp - 1) * 2 * u * (4 + 4)
    a2a = Fraction(cp - 1, cp) * 4 * u * 4  # each way
    for mode, forwards in (("none", 1), ("selective", 2), ("full", 2)):
        layout = Layout(dims, microbatch_size=b, microbatches=m, recompute=mode)
        ring = cp_theory.cp_comm(CFG, layout)
        per_rank = L * m * (forwards * ring_fwd + ring_bwd) + grads
        assert Fraction(ring["sent_bytes_per_step_exact"]) == per_rank * d * cp
        assert Fraction(ring["by_group"]["dp_cp"]["sent_bytes_exact"]) == grads * d * cp
        ulysses = cp_theory.cp_comm(CFG, layout_of(dims, microbatch_size=b, microbatches=m, recompute=mode,
                                                   cp_kind="a2a"))
        assert Fraction(ulysses["by_group"]["cp"]["sent_bytes_exact"]) == L * m * (forwards + 1) * a2a * d * cp


def test_zero_over_dp_x_cp_shards_over_every_replica():
    dims = ParallelDims.resolve(4, dp=2, cp=2)
    for stage, scatters in ((1, 1), (2, 2)):
        fig = cp_theory.cp_comm(CFG, layout_of(dims, microbatch_size=4, microbatches=2, zero=stage))
        padded = algebra.zero_padded_parameter_count(CFG, 4) * 4
        assert Fraction(fig["by_group"]["dp_cp"]["sent_bytes_exact"]) == Fraction(3, 4) * (1 + scatters) * padded * 4
        state = cp_theory.cp_model_state_bytes(CFG, layout_of(dims, zero=stage))
        assert state["optimizer_bytes"] == 2 * padded // 4


# -- the plan --------------------------------------------------------------------------------------
def _plan(world: int, *overrides):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", *overrides])
    return build_plan(cfg, LaunchEnv(world_size=world, local_world_size=world), cuda_available=False)


@pytest.mark.parametrize("world,overrides,error,message", [
    (2, ["parallel=cp", "model.seq_len=30"], ConfigError,
     "model.seq_len=30 is not divisible by 2 x cp = 4: the load-balanced layout cuts the sequence into 2·cp equal "
     "chunks; use a seq_len that is a multiple of 4 (e.g. 28)"),
    (4, ["parallel=cp_a2a", "parallel.cp=4", "parallel.tp=1", "model.n_heads=2", "model.d_model=64"], ConfigError,
     "parallel.cp=4 does not divide the 2 attention heads per rank"),
    (4, ["parallel=cp_a2a", "parallel.tp=2", "model.n_heads=2", "model.d_model=64"], ConfigError,
     "parallel.cp=2 does not divide the 1 attention heads per rank"),
    (2, ["parallel=cp_a2a", "model.d_model=96", "model.n_heads=6", "+model.n_kv_heads=3"], ConfigError,
     "parallel.cp=2 neither divides nor is a multiple of the 3 K/V heads per rank (model.n_kv_heads over tp): "
     "the all-to-all gives each rank kv heads/cp whole kv heads, or one replica where cp is a multiple of them; "
     "use cp in [1, 3, 6], or the ring (parallel=cp)"),
    (2, ["parallel=cp", "model.dropout=0.1"], ConfigError, "model.dropout=0.1 inside attention"),
    (2, ["parallel=cp", "model=tiny_moe"], ConfigError,
     "parallel=cp does not train a mixture-of-experts model (model.moe_experts=4)"),
    (8, ["parallel=cp", "parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=20"], ConfigError,
     "model.seq_len=20 / parallel.cp=2 = 10 tokens per cp rank do not split into parallel.tp=4"),
    (4, ["parallel=cp", "parallel.zero=3"], ConfigError, "parallel.zero=3 does not compose with parallel.cp=2"),
    (2, ["parallel=torch_ddp", "train.recompute=full"], ConfigError,
     "train.recompute=full is this project's transform of its own blocks"),
    (1, ["parallel=single", "train.recompute=some"], ConfigError, "train.recompute='some' is not one of none, "),
    (4, ["parallel=dp", "parallel.cp=2"], LayoutError,
     "parallel=dp does not split along cp: set parallel.cp=1 (context parallelism: parallel=cp or cp_a2a)"),
    (3, ["parallel=cp"], LayoutError,
     "world size 3 is not divisible by parallel.cp x parallel.tp x parallel.pp = 2 x 1 x 1 = 2"),
])
def test_what_cp_or_recomputation_cannot_run_is_refused_in_one_line(world, overrides, error, message):
    with pytest.raises(error) as refused:
        _plan(world, *overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("world,overrides,strategy,layout", [
    (4, ["parallel=cp"], "cp", (2, 2, 1, 1, "ring", 0)),
    (4, ["parallel=cp_a2a", "parallel.cp=4"], "cp_a2a", (1, 4, 1, 1, "a2a", 0)),
    (4, ["parallel=cp", "parallel.zero=2"], "cp", (2, 2, 1, 1, "ring", 2)),
    (4, ["parallel=cp_a2a", "parallel.tp=2"], "3d", (1, 2, 2, 1, "a2a", 0)),
    (8, ["parallel=cp", "parallel.pp=2", "parallel.tp=2", "parallel.zero=1"], "3d", (1, 2, 2, 2, "ring", 1)),
    (4, ["parallel=tp", "parallel.cp=2"], "3d", (1, 2, 2, 1, "ring", 0)),
    (4, ["parallel=pp_1f1b", "parallel.cp=2"], "3d", (1, 2, 1, 2, "ring", 0)),
    (2, ["parallel=cp", "parallel.cp=1"], "dp", (2, 1, 1, 1, "ring", 0)),
])
def test_routes_put_cp_with_tp_or_pp_on_the_one_mesh(world, overrides, strategy, layout):
    plan = _plan(world, *overrides)
    dims = plan.dims
    assert plan.strategy == strategy
    assert (dims.dp, dims.cp, dims.tp, dims.pp, option(plan, "cp_kind"), option(plan, "zero")) == layout
    assert (option(plan, "cp_kind"), plan.layout.recompute) == (option(plan, "cp_kind"), "none")
