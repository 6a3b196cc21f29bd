"""PyTorch's own implementations on the same model and data, as baselines to measure against.

Their traffic goes through the same communication log: DDP lets us replace its all-reduce with a
communication hook, so every bucket it sends is counted by `comm.py` exactly as ours are.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .comm import Communicator
from .strategy import Strategy


def _counted_allreduce_hook(comm: Communicator):
    """A DDP comm hook that sums each bucket through the communication log.

    DDP's built-in hook divides by the world size (it averages); ours sums, because every
    microbatch loss is already divided by the global token count (see strategy.py).
    """

    def hook(_state, bucket):
        return comm.all_reduce_future(bucket.buffer(), tag=f"grads/bucket{bucket.index()}")

    return hook


class TorchDDP(Strategy):
    name = "torch_ddp"

    def __init__(self, model, optimizer_factory, dp_comm: Communicator, bucket_mb: float):
        ddp = DDP(
            model,
            process_group=dp_comm.group,
            bucket_cap_mb=bucket_mb,
            # The model is built identically from one seed on every rank; skipping DDP's
            # initial parameter broadcast keeps all traffic inside the communication log.
            # (The GPT has no buffers, so DDP has none to broadcast in forward either.)
            init_sync=False,
        )
        ddp.register_comm_hook(None, _counted_allreduce_hook(dp_comm))
        super().__init__(ddp, optimizer_factory(ddp.module), loss_comm=dp_comm)

    def backward_context(self, last_microbatch: bool):
        # DDP's own way of accumulating without communicating.
        return contextlib.nullcontext() if last_microbatch else self.model.no_sync()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.module.state_dict().items()}

    def named_full_parameters(self):
        return self.model.module.named_parameters()  # without DDP's "module." prefix

    def full_grads(self) -> dict:
        return {"grads": {n: p.grad.detach().cpu().clone() for n, p in self.model.module.named_parameters()},
                "tp_replica_max_diff": {}}
