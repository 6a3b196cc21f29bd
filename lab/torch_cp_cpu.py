"""Why the comparison has no PyTorch context-parallel row: PyTorch's own cp, tried on gloo and the CPU.

    python -m lab.torch_cp_cpu

Spawns 2 gloo ranks on this machine (a 1-D "cp" mesh) and tries the three ways the installed
PyTorch offers to run causal attention over a sequence split across them, forward and backward, as
training needs. Each prints "ran" or its exception's first line (docs/context-parallel.md quotes them);
what follows is why each failed on the PyTorch this project pins:

  1. `context_parallel(mesh, buffers=[x], buffer_seq_dims=[2])` around
     F.scaled_dot_product_attention (the API torchtitan uses): on the CPU, SDPA dispatches to
     aten._scaled_dot_product_flash_attention_for_cpu, which the CP dispatcher does not handle and
     for which DTensor has no sharding strategy;
  2. the same under sdpa_kernel(SDPBackend.MATH): the math path decomposes into ops on a mix of
     DTensors and plain tensors, which DTensor refuses;
  3. `_ContextParallel(FLEX)` (parallelize_module) around flex_attention with a cp block mask:
     FlexAttention has no backward on the CPU (and the mask needs s to be a multiple of cp·128).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

B, HEADS, HEAD_DIM = 2, 4, 16


def attempt(name: str, fn, rank: int) -> None:
    try:
        fn()
        outcome = "ran"
    except Exception as e:  # the point is to report whatever PyTorch raises
        outcome = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    if rank == 0:
        print(f"{name}: {outcome}", flush=True)


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _ContextParallel,
        _create_cp_block_mask,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    weights = torch.randn(3, HEAD_DIM, HEAD_DIM, requires_grad=True)  # q, k, v projections

    def sdpa():
        x = torch.randn(B, HEADS, 32, HEAD_DIM)  # the sequence-dependent buffer, sharded in place
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            q, k, v = (x @ weights[i] for i in range(3))
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def sdpa_math():
        with sdpa_kernel(SDPBackend.MATH):
            sdpa()

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask)

    def flex():
        attention = parallelize_module(Attention(), mesh, _ContextParallel(
            seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
        seq = 2 * 128  # the cp block mask wants s divisible by cp x its 128-token blocks
        mask = _create_cp_block_mask(lambda b, h, qi, ki: qi >= ki, B=B, H=HEADS, Q_LEN=seq, KV_LEN=seq,
                                     device_mesh=mesh)
        x = torch.randn(B, HEADS, seq // 2, HEAD_DIM)  # this rank's half of the sequence
        q, k, v = (x @ weights[i] for i in range(3))
        attention(q, k, v, block_mask=mask).sum().backward()

    attempt("context_parallel + SDPA", sdpa, rank)
    attempt("context_parallel + SDPA, math backend", sdpa_math, rank)
    attempt("_ContextParallel(FLEX) + flex_attention", flex, rank)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch {torch.__version__}, gloo, 2 CPU ranks", flush=True)
    mp.spawn(worker, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
