"""ZeRO stages 1, 2, 3 and PyTorch FSDP2 against the single run, theory and the memory formula.

Each multi-process case trains the tiny model for 6 steps under torchrun on gloo and checks:
  * per-step losses within 1e-5 relative of the single-process run, and the same final parameters;
  * the bytes logged per step equal parallel/zero/theory.py exactly, and the ZeRO paper's closed form written
    out here: (N-1)/N·(G + P) per rank for stages 1 and 2 (m·G + P for stage 2 with m
    microbatches: it reduce-scatters every microbatch), m·(N-1)/N·(2P + G) for stage 3, with
    P = G = 4·Ψ_pad bytes and Ψ_pad = Σ_parts ceil(Ψ_part/N)·N;
  * every rank's parameter, gradient and optimizer-state bytes (measured from the tensors it
    holds) equal the formula: 4Ψ_pad + 4Ψ_pad + 8Ψ_pad/N (stage 1), 4Ψ_pad + (4 + 8)Ψ_pad/N
    (stage 2), 16Ψ_pad/N (stage 3).
The tiny model's parts are multiples of 64 elements, so dp 2 and 4 need no padding; the dp 3 run
does (each Block's 49,984 parameters pad to 49,986). One zero3 case trains the Llama-shaped twin
(model=tiny_llama: K and V of 2 heads' width, a SwiGLU MLP of 192, RMSNorm, no biases, no position table).
"""

from fractions import Fraction

import pytest
import torch
from launcher import TINY, TINY_LLAMA, assert_ok, check_matches_single
from observability import check_time_breakdown, check_trace

from parallel.core.model import GPT, GPTConfig
from parallel.strategy import make_optimizer
from parallel.sync.shards import ShardAdamW, group_into_parts

V, H, S, L = 256, 64, 32, 4  # the tiny model
H_KV, F = 32, 192  # tiny_llama: 2 of its 4 heads of 16 for K and V, the SwiGLU width
# Each part's parameters: the embedding, a Block, the head (final norm and the untied head).
PARTS = {
    "tiny": (V * H + S * H, 12 * H * H + 13 * H, 2 * H + V * H),
    # RMSNorm's weight only, Q and the output projection h·h, K and V h·h_kv, gate, up and down h·f.
    "tiny_llama": (V * H, 2 * H + 2 * H * H + 2 * H * H_KV + 3 * H * F, H + V * H),
}


def padded_psi(n: int, model: str = "tiny") -> int:
    embed, block, head = PARTS[model]
    return sum(-(-p // n) * n for p in (embed, *[block] * L, head))


def check_zero_traffic(s, stage: int, n: int, m: int, model: str = "tiny"):
    comm = s["comm"]
    P = G = 4 * padded_psi(n, model)
    per_rank = {1: Fraction(n - 1, n) * (G + P), 2: Fraction(n - 1, n) * (m * G + P),
                3: m * Fraction(n - 1, n) * (2 * P + G)}[stage]
    assert Fraction(comm["sent_bytes_per_step_exact"]) == per_rank * n
    assert Fraction(s["expected_comm"]["sent_bytes_per_step_exact"]) == per_rank * n
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    assert set(comm["by_op"]) == {"all_gather", "reduce_scatter"} and list(comm["by_group"]) == ["dp"]
    parts = ["embed", *(f"blocks.{i}" for i in range(L)), "head"]
    gathers = {"fwd": m, "bwd": m} if stage == 3 else {"": 1}
    scatters = 1 if stage == 1 else m
    for part in parts:
        assert comm["by_tag"][f"zero/grad_reduce_scatter/{part}"]["calls"] == scatters * n
        for direction, calls in gathers.items():
            tag = f"zero/param_all_gather/{direction}/{part}" if direction else f"zero/param_all_gather/{part}"
            assert comm["by_tag"][tag]["calls"] == calls * n


def check_zero_memory(s, stage: int, n: int, model: str = "tiny"):
    psi = padded_psi(n, model)
    expected = {"param_bytes": 4 * psi if stage < 3 else 4 * psi // n,
                "grad_bytes": 4 * psi if stage < 2 else 4 * psi // n,
                "optimizer_bytes": 8 * psi // n}
    memory = s["memory"]
    assert memory["matches_formula"] is True
    assert {k: memory["formula"][k] for k in expected} == expected
    assert len(memory["by_rank"]) == n
    for row in memory["by_rank"]:
        assert {k: row[k] for k in expected} == expected, row
        if stage == 3:
            # Gathered parameters and full gradients come and go during the step: the peak holds
            # at least one whole part's parameters beyond the shards.
            assert row["peak_model_state_bytes"] >= row["total_bytes"] + 4 * PARTS[model][1]
        else:
            assert row["peak_model_state_bytes"] >= row["total_bytes"]


@pytest.mark.parametrize("stage,world,microbatches,model", [
    (1, 2, 2, "tiny"), (1, 4, 1, "tiny"), (2, 2, 1, "tiny"), (2, 4, 2, "tiny"), (3, 2, 2, "tiny"), (3, 4, 1, "tiny"),
    (3, 3, 1, "tiny"), (3, 2, 2, "tiny_llama"),
])
def test_zero_matches_single_theory_and_memory_formula(stage, world, microbatches, model, request, pools, tmp_path):
    global_batch = ["train.global_batch=12"] if world == 3 else []
    base = TINY_LLAMA if model == "tiny_llama" else TINY
    run = pools.run(world, [*base, *global_batch, f"parallel=zero{stage}", f"parallel.microbatches={microbatches}",
                            "train.save_final=true"], tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == f"zero{stage}" and s["parallel"]["dp"] == world
    if world == 3:
        # A different global batch: compare with theory and the formula only (and padding is real).
        assert padded_psi(3) > s["model"]["parameters"]
    else:
        reference = "single_run_llama" if model == "tiny_llama" else "single_run"
        check_matches_single(run, request.getfixturevalue(reference))
    assert s["model"]["parameters"] == padded_psi(1, model)
    check_zero_traffic(s, stage, world, microbatches, model)
    check_zero_memory(s, stage, world, model)
    if stage == 2:
        # The parameter all-gather after the optimizer step is communication, not optimizer time.
        parts = check_time_breakdown(s)
        assert parts["optimizer"] > 0 and s["time_breakdown"]["exposed_comm_s"].get("all_gather dp", 0) > 0
        check_trace(run.run_dir, s)


def test_torch_fsdp2_matches_single_and_theory(single_run, pools, tmp_path):
    run = pools.run(2, [*TINY, "parallel=torch_fsdp2", "train.save_final=true"], tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "torch_fsdp2"
    check_matches_single(run, single_run)
    # On the CPU FSDP2 has no side streams: its collectives are timed as any call (not so on CUDA).
    assert s["exposed_comm_measured"] is True
    comm = s["comm"]
    # Its all-gathers and reduce-scatters went through our log (custom FSDP2 collectives): each
    # Block gathered twice (forward, backward), the root once, every group reduce-scattered once.
    assert s["comm_matches_theory"] is True
    assert comm["by_tag"]["fsdp2/param_all_gather/blocks.0"]["calls"] == 2 * 2
    assert comm["by_tag"]["fsdp2/param_all_gather/root"]["calls"] == 1 * 2
    assert comm["by_tag"]["fsdp2/grad_reduce_scatter/root"]["calls"] == 1 * 2
    # At dp 2 nothing of the tiny model needs padding: FSDP2 holds 16Ψ/N bytes per rank, as zero3.
    psi = s["model"]["parameters"]
    for row in s["memory"]["by_rank"]:
        assert (row["param_bytes"], row["grad_bytes"], row["optimizer_bytes"]) \
            == (4 * psi // 2, 4 * psi // 2, 8 * psi // 2)


def test_torch_zero1_matches_single_and_theory(single_run, pools, tmp_path):
    """PyTorch's ZeRO-1 (DDP + ZeroRedundancyOptimizer): DDP all-reduces the whole gradient, then every
    parameter is broadcast from its owner: 2(N-1)/N·G + P per rank, counted in our log."""
    run = pools.run(2, [*TINY, "parallel=torch_zero1", "parallel.microbatches=2", "train.save_final=true"],
                    tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "torch_zero1"
    check_matches_single(run, single_run)
    comm, n = s["comm"], 2
    psi = s["model"]["parameters"]
    assert Fraction(comm["sent_bytes_per_step_exact"]) == n * (Fraction(2 * (n - 1), n) * 4 * psi + 4 * psi)
    assert s["comm_matches_theory"] is True and set(comm["by_op"]) == {"all_reduce", "broadcast"}
    # Every parameter broadcast once per step, each from one of the two owners.
    calls = sum(v["calls"] for k, v in comm["by_tag"].items() if k.startswith("zero1/param_broadcast/"))
    assert calls == n * len(run.final_params)
    assert {k for k in comm["by_tag"] if k.startswith("zero1/")} == {f"zero1/param_broadcast/from{r}" for r in range(n)}
    # Each rank holds Adam's moments only for the parameters it owns: together, all of them.
    assert sum(row["optimizer_bytes"] for row in s["memory"]["by_rank"]) == 8 * psi


def test_torch_zero2_matches_single_and_theory(single_run, pools, tmp_path):
    """PyTorch's ZeRO-2 (FSDP2, reshard_after_forward=False, unsharded across the step's microbatches):
    each group gathered once per step, its gradients reduce-scattered every microbatch, (N-1)/N·(P + m·G)."""
    m, n = 2, 2
    run = pools.run(n, [*TINY, "parallel=torch_zero2", f"parallel.microbatches={m}", "train.save_final=true"],
                    tmp_path / "run")
    s = assert_ok(run)
    assert s["strategy"] == "torch_zero2"
    check_matches_single(run, single_run)
    comm = s["comm"]
    P = G = 4 * padded_psi(n)  # at dp 2 FSDP2's per-parameter padding adds nothing either
    assert Fraction(comm["sent_bytes_per_step_exact"]) == n * Fraction(n - 1, n) * (P + m * G)
    assert s["comm_matches_theory"] is True
    for group in ("blocks.0", "root"):
        assert comm["by_tag"][f"fsdp2/param_all_gather/{group}"]["calls"] == 1 * n
        assert comm["by_tag"][f"fsdp2/grad_reduce_scatter/{group}"]["calls"] == m * n
    psi = s["model"]["parameters"]
    for row in s["memory"]["by_rank"]:
        assert (row["grad_bytes"], row["optimizer_bytes"]) == (4 * psi // n, 8 * psi // n)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_optimizer_is_bitwise_adamw(world):
    """The shards, stepped piece by piece, end bitwise equal to AdamW on the whole parameters."""
    cfg = GPTConfig()
    reference = GPT(cfg, seed=0)
    optimizer = make_optimizer(reference, 1e-3, 0.1)
    gen = torch.Generator().manual_seed(1)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in reference.named_parameters()} for _ in range(3)]
    for g in grads:
        for n, p in reference.named_parameters():
            p.grad = g[n]
        optimizer.step()
    shards_by_rank = []
    for rank in range(world):
        parts = group_into_parts(list(GPT(cfg, seed=0).named_parameters()), world, rank)
        shards = [part.flatten([p.detach() for p in part.params])[part.lo: part.hi].clone() for part in parts]
        grad_shards = [torch.zeros_like(s) for s in shards]
        shard_optimizer = ShardAdamW(parts, shards, grad_shards, 1e-3, 0.1)
        for g in grads:
            for part, grad in zip(parts, grad_shards):
                grad.copy_(part.flatten([g[n] for n in part.names])[part.lo: part.hi])
            shard_optimizer.step()
        shards_by_rank.append(shards)
        assert shard_optimizer.state_bytes() == 8 * sum(part.shard_numel for part in parts)
    reference_params = dict(reference.named_parameters())
    for k, part in enumerate(parts):
        full = torch.cat([shards[k] for shards in shards_by_rank])
        assert torch.all(full[part.numel:] == 0), "padding must stay zero"
        for name, value in part.unflatten(full).items():
            assert torch.equal(value, reference_params[name].detach()), name


# -- layouts ----------------------------------------------------------------------------------------
def plan_for(world: int, *overrides: str):
    from hydra import compose, initialize_config_dir
    from launcher import PROJECT_ROOT

    from parallel.dist.groups import LaunchEnv
    from parallel.run_plan import build_plan

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return build_plan(cfg, LaunchEnv(rank=0, world_size=world, local_world_size=world), cuda_available=False)


@pytest.mark.parametrize("preset", ["zero1", "zero2", "zero3", "torch_fsdp2"])
def test_sharded_presets_are_pure_data_parallel(preset):
    from parallel.dist.dims import LayoutError

    plan = plan_for(4, f"parallel={preset}")
    assert (plan.strategy, plan.dims.dp, plan.dims.tp, plan.dims.pp) == (preset, 4, 1, 1)
    with pytest.raises(LayoutError,
                       match=rf"parallel={preset} is data parallel only, but parallel.tp=2 and parallel.pp=1"):
        plan_for(4, f"parallel={preset}", "parallel.tp=2")
    with pytest.raises(LayoutError,
                       match=rf"parallel={preset} shards the model state over data-parallel ranks "
                             r"and needs at least 2"):
        plan_for(1, f"parallel={preset}")


def test_checkpoint_interface_round_trip():
    """full_state_dict / full_optimizer_state / load_full_state of zero1-3, FSDP2 and PyTorch's ZeRO-1/2 at
    dp 3 (padded parts, uneven FSDP2 chunks, ZeroRedundancyOptimizer's uneven ownership): see
    tests/helpers/checkpoint_roundtrip.py."""
    import subprocess
    import sys

    from launcher import PROJECT_ROOT

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           str(PROJECT_ROOT / "tests" / "helpers" / "checkpoint_roundtrip.py")],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for name in ("zero1", "zero2", "zero3", "torch_fsdp2", "torch_zero1", "torch_zero2"):
        assert f"{name}: checkpoint round trip ok" in proc.stdout
