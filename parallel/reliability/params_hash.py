"""One fingerprint of a model's parameters, whatever layout trained it.

`params_sha256` hashes the full model's state as single-process names map it (what every
strategy's `full_state_dict()` returns, shards gathered): the names in sorted order, and for each
its name, dtype and shape, then the bytes of the tensor, contiguous, on the CPU. Two runs hash
alike exactly when every parameter is bitwise equal; the sharding that held them does not enter.
So an uninterrupted run and a run restarted from checkpoints hash alike if and only if recovery
lost nothing. (Two *layouts* sum in different orders and agree only within about 1e-5, so their
hashes differ: compare those with a tolerance, not a hash.)
"""

from __future__ import annotations

import hashlib

import torch


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
