"""Model FLOPs utilisation: the model's useful FLOPs per second over what the hardware can do.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; training = forward + backward):

    6·N + 12·L·h·s

  6·N       every weight of a matrix multiply is used in one multiply-add (2 FLOPs) forward
            and two backward (input and weight gradients): 6 FLOPs per weight per token.
            N = all parameters but the token and position tables (lookups, not multiplies);
            the untied head is a matmul and counts. Biases and LayerNorms stay in N: a
            sub-leading term (Kaplan et al.'s non-embedding count drops them; < 1% here).
            With experts, N counts the k experts a token goes to, not all E (the active
            parameters; a dropped assignment still counts, as the model's nominal FLOPs).
  12·L·h·s  attention's own matmuls, which have no weights: Q·Kᵀ and (softmax)·V, each
            2·s·h FLOPs per token per layer forward (full s x s scores, as the model computes
            them, causal mask or not), times 3 for forward + backward.

The peak is measured, not looked up: the best of many large fp32 matmuls on the run's device
(on CPU one thread's best times the usable cores; on a GPU timed with CUDA events). MFU = achieved model FLOPs/s of the
whole run / (peak per device x devices); on CPU the ranks share one machine, so devices = 1.
"""

from __future__ import annotations

import time

import torch

from parallel.algebra import active_parameter_count
from parallel.core.model import GPTConfig
from parallel.dist.binding import host_cores


def matmul_parameters(model: GPTConfig) -> int:
    """N: every parameter a token uses but the token and position embedding tables (parallel/algebra.py's
    active count, Ψ for a dense model, minus them)."""
    return active_parameter_count(model) - model.padded_vocab_size * model.d_model - model.seq_len * model.d_model


def flops_per_token(model: GPTConfig) -> int:
    """Training FLOPs per token: 6·N + 12·L·h·s (PaLM appendix B)."""
    return 6 * matmul_parameters(model) + 12 * model.n_layers * model.d_model * model.seq_len


def usable_cores() -> int:
    """The cores this machine's ranks may run on (the process's affinity), not the host's count: a
    container often sees many more CPUs in os.cpu_count() than it is allowed, and oversubscribed
    threads would measure a fraction of the real peak. In a rank bound to a core of its own
    (`train.pin_cores`), the cores its machine's ranks shared before (parallel/dist/binding.py)."""
    return host_cores()


PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_peak_flops(device: torch.device, size: int | None = None, repeats: int = 5, min_seconds: float = 1.0,
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOPs/s of the best of at least `repeats` square matmuls of `size` in `dtype` on `device`,
    repeated for at least `min_seconds` on CPU.

    The dtype is the run's compute dtype (train.precision): a GPU's bf16 peak is many times its
    fp32 one, so MFU against the other dtype's peak would be off by that factor.

    CPU: the whole machine (the ranks of a CPU run share it), as one thread's best rate times the
    usable cores. The best of many is the estimate because other work on a shared machine only
    ever slows a matmul down: a peak measured while others hold the cores is too low, and MFU
    against it too high (it can pass 100%).
    CUDA: timed with CUDA events after a warm-up, so the launch is not what is measured.
    """
    device = torch.device(device)
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3
    if device.type == "cuda":
        torch.matmul(a, b)
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return flops / best
    # One core's rate times the cores: on a machine shared with other jobs, one thread finds a free
    # core far more often than several threads find all of them free at once, so the best
    # single-thread matmul is the steadier estimate of what each core can do.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.matmul(a, b)  # warm-up: thread pool, caches
        best, began, done = float("inf"), time.perf_counter(), 0
        while done < repeats or time.perf_counter() - began < min_seconds:
            start = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - start)
            done += 1
    finally:
        torch.set_num_threads(threads)
    return usable_cores() * flops / best


def devices_for_peak(device: torch.device, world_size: int) -> int:
    """How many peaks the run had: one per GPU; one CPU machine shared by all its ranks."""
    return world_size if torch.device(device).type == "cuda" else 1


def mfu(model: GPTConfig, tokens_per_s: float, peak_flops_per_device: float, devices: int) -> float:
    return flops_per_token(model) * tokens_per_s / (peak_flops_per_device * devices)
