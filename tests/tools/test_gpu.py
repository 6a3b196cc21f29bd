"""The GPU path: device choice, bf16 autocast, and the runs that need CUDA.

The first tests run everywhere (the choice of device, bf16 autocast on the CPU). The tests marked
`gpu` need CUDA and skip with the reason on machines without it; `launch/gpu_check.sh` runs them
on a GPU machine. Their CPU reference is the session's single run (tests/conftest.py), which
runs on the CPU even where a GPU is visible.
"""

import pytest
import torch
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT, TINY, assert_ok, max_rel_diff, run_train

from parallel.core.data import Batch
from parallel.core.model import GPT, GPTConfig
from parallel.core.precision import ForwardContext
from parallel.dist.groups import LaunchEnv, choose_device_type
from parallel.run_plan import ConfigError, build_plan
from parallel.strategy import SingleProcess, make_optimizer
from parallel.train import _check_forward_context

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(N_GPUS == 0, reason="needs a CUDA GPU; none is visible on this machine")
TINY_GLOBAL_BATCH = int(next(o for o in TINY if o.startswith("train.global_batch=")).split("=")[1])
needs_two_gpus = pytest.mark.skipif(N_GPUS < 2,
                                    reason=f"NCCL needs one GPU per rank: needs 2 or more, {N_GPUS} visible")


def test_device_choice():
    # NCCL ranks each take a GPU; a single process takes the GPU when one is visible, unless
    # parallel.backend=gloo asks for the CPU; gloo ranks keep their tensors on the CPU.
    assert choose_device_type("auto", "nccl", cuda_available=True) == "cuda"
    assert choose_device_type("auto", None, cuda_available=True) == "cuda"
    assert choose_device_type("gloo", None, cuda_available=True) == "cpu"
    assert choose_device_type("gloo", "gloo", cuda_available=True) == "cpu"
    assert choose_device_type("auto", None, cuda_available=False) == "cpu"
    assert choose_device_type("auto", "gloo", cuda_available=False) == "cpu"


def _plan(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", *overrides])
    return build_plan(cfg, LaunchEnv(), cuda_available=False)


def test_bf16_forward_context_autocasts_each_microbatch_and_is_required():
    cpu = torch.device("cpu")
    with ForwardContext("bf16", cpu)():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    with ForwardContext("fp32", cpu)():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32

    model = GPT(GPTConfig(), seed=0)
    strategy = SingleProcess(model, make_optimizer(model, 1e-3, 0.1))
    strategy.forward_context = ForwardContext("bf16", cpu)
    bf16 = _plan("train.precision=bf16")
    # A strategy that has not run its forward inside the context would train in fp32: refused.
    with pytest.raises(ConfigError, match="train.precision=bf16 is not implemented by parallel=single"):
        _check_forward_context(bf16, strategy)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    strategy.train_step(Batch(tokens[:, :-1], tokens[:, 1:]).split(2), global_tokens=4 * 32)
    assert strategy.forward_context.entered == 2  # once per microbatch
    _check_forward_context(bf16, strategy)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    strategy.forward_context = ForwardContext("fp32", cpu)
    _check_forward_context(_plan(), strategy)  # fp32 needs nothing


def test_bf16_autocast_trains_on_cpu(single_run, pools, tmp_path):
    """bf16 changes the numbers (autocast is really on) but not the training: the loss falls,
    and stays within bf16's rounding of the fp32 run."""
    summary = assert_ok(pools.run(1, [*TINY, "parallel=single", "train.precision=bf16"], tmp_path / "run"))
    losses, fp32 = summary["losses"], single_run.summary["losses"]
    assert (summary["precision"], summary["device"]) == ("bf16", "cpu")
    assert losses[-1] < losses[0]
    assert losses != fp32
    assert max_rel_diff(losses, fp32) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_single_on_cuda_matches_cpu(single_run, tmp_path):
    """fp32 on the GPU (TF32 matmuls are off by default) starts from the CPU's loss; later steps
    drift by summation order only."""
    summary = assert_ok(run_train(1, [*TINY, "parallel=single"], tmp_path / "run", gpu=True))
    ref = single_run.summary
    assert (summary["device"], ref["device"]) == ("cuda", "cpu")
    assert abs(summary["losses"][0] - ref["losses"][0]) / ref["losses"][0] < 1e-5
    assert max_rel_diff(summary["losses"], ref["losses"]) < 1e-3
    # Memory from the CUDA allocator: the tiny model's tensors, far below the CPU process's RSS, and
    # the timed steps' peak (reset after the warm-up).
    assert 0 < summary["peak_memory_bytes"] < ref["peak_memory_bytes"]
    assert summary["peak_memory_scope"].startswith("the timed steps")
    # The activation formula is the CPU attention kernel's: on CUDA it is not claimed either way.
    memory = summary["memory"]
    assert memory["activations_match_theory"] is None and ref["memory"]["activations_match_theory"] is True
    assert memory["activations_check_note"].startswith("not checked on CUDA: ")


@pytest.mark.gpu
@needs_gpu
def test_bf16_on_cuda_trains(single_run, tmp_path):
    summary = assert_ok(run_train(1, [*TINY, "parallel=single", "train.precision=bf16"], tmp_path / "run", gpu=True))
    losses = summary["losses"]
    assert (summary["precision"], summary["device"]) == ("bf16", "cuda")
    assert losses[-1] < losses[0]
    assert max_rel_diff(losses, single_run.summary["losses"]) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_gloo_ranks_run_on_the_cpu_of_a_gpu_machine(single_run, tmp_path):
    """What a one-GPU machine can do with several ranks: gloo, tensors on the CPU."""
    run = run_train(2, [*TINY, "parallel=dp", "parallel.backend=gloo", "train.save_final=true"], tmp_path / "run",
                    gpu=True)
    summary = assert_ok(run)
    assert (summary["parallel"]["backend"], summary["device"]) == ("gloo", "cpu")
    assert max_rel_diff(summary["losses"], single_run.summary["losses"]) < 1e-5


@pytest.mark.gpu
@needs_gpu
def test_more_nccl_ranks_than_gpus_is_refused(tmp_path):
    n = N_GPUS + 1
    run = run_train(n, [*TINY, "parallel=dp", f"train.global_batch={2 * n}"], tmp_path / "run", timeout=120, gpu=True)
    assert run.returncode != 0
    assert f"{n} processes on this node run on CUDA, one GPU each, but {N_GPUS} GPU(s) are visible" in run.stderr


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("overrides",
                         [["parallel=dp"], ["parallel=tp", "parallel.tp=2"], ["parallel=pp_1f1b", "parallel.dp=1"]],
                         ids=["dp", "tp", "pp"])
def test_nccl_matches_single(overrides, single_run, tmp_path):
    """Every GPU a rank, NCCL chosen automatically; the losses match the CPU's single run to
    within the GPU's summation order, and the traffic matches theory exactly."""
    world = 2 if "parallel=tp" in overrides or "parallel=pp_1f1b" in overrides else N_GPUS
    if TINY_GLOBAL_BATCH % world:
        pytest.skip(f"train.global_batch={TINY_GLOBAL_BATCH} does not split over {world} GPUs")
    summary = assert_ok(run_train(world, [*TINY, *overrides], tmp_path / "run", gpu=True))
    assert (summary["parallel"]["backend"], summary["device"]) == ("nccl", "cuda")
    assert summary["comm_matches_theory"]
    assert max_rel_diff(summary["losses"], single_run.summary["losses"]) < 1e-3


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("preset,measured", [("torch_fsdp2", False), ("torch_tp", True), ("torch_pp_1f1b", True)])
def test_baselines_on_nccl_time_what_the_compute_stream_waits(preset, measured, single_run, tmp_path):
    """DTensor's and torch pipelining's waits are timed by CUDA events on the compute stream; FSDP2's
    collectives run on its own streams, so its exposed communication is reported as not measured."""
    summary = assert_ok(run_train(2, [*TINY, f"parallel={preset}"], tmp_path / "run", gpu=True))
    assert (summary["parallel"]["backend"], summary["device"]) == ("nccl", "cuda")
    assert summary["exposed_comm_measured"] is measured
    notes = " ".join(summary["time_breakdown"]["notes"])
    assert ("FSDP2 runs its all-gathers and reduce-scatters on CUDA streams of its own" in notes) is not measured
    assert max_rel_diff(summary["losses"], single_run.summary["losses"]) < 1e-3


def test_the_sweep_parent_asks_for_the_gpus_without_initialising_cuda():
    """launch.compare's parent and the pool's ranks import, and the parent asks for the machine's
    GPUs (a child process asks CUDA where torch has it), and CUDA is still uninitialised in the
    parent: on a GPU machine the point of it, on a CPU-only one a check that nothing regressed."""
    import subprocess
    import sys

    code = ("import launch.compare, launch.forkserver, torch\n"
            "from parallel.compare.devices import sweep_machine\n"
            "machine = sweep_machine(None)\n"
            "print(machine.device_type, machine.gpus, torch.cuda.is_initialized())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    device_type, gpus, initialised = done.stdout.split()
    assert initialised == "False"
    assert (device_type, int(gpus)) == (("cuda", N_GPUS) if N_GPUS else ("cpu", 0))
