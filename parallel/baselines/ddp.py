"""PyTorch's DistributedDataParallel, bare and under Hugging Face accelerate: the baselines for `dp`.

Their traffic goes through the same communication log: DDP lets us replace its all-reduce with a
communication hook, so every byte it sends is counted by parallel/dist/comm.py exactly as ours are.
With parallel.comm_dtype=bf16 the hook is PyTorch's own bf16_compress_hook (the counterpart of dp's
bf16 all-reduce, parallel/sync/lowprec.py), its all-reduce counted by parallel/baselines/counting.py.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.baselines.counting import counted_bf16_compress_hook
from parallel.core.data import Batch
from parallel.dist.comm import Communicator
from parallel.strategy import Strategy

# What the time breakdown of a DDP run cannot split (parallel/report/breakdown.py).
DDP_NOTE = ("DDP waits for its bucket all-reduces inside backward (its C++ reducer's final callback), out of the "
            "communication log's sight: that wait is counted as backward compute, so exposed comm shows only the "
            "finite check; compare DDP's compute + exposed comm with dp's")


# DDP's default bucket cap (torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB).
DDP_DEFAULT_BUCKET_MB = 25


def ddp_bucket_cap_mb(bucket_mb: float) -> float | None:
    """What to hand DDP as bucket_cap_mb. DDP (torch 2.13, `_BucketCapConfig`) gives its first
    bucket 1 MiB only when bucket_cap_mb is left at None; given explicitly, even as its default 25,
    the first bucket takes the full cap (on `small`: one 25.9 MB bucket instead of 1.3 + 24.6 MB).
    parallel.bucket_mb at DDP's default is passed as None, so DDP buckets as it does out of the box,
    and as dp does (parallel/sync/allreduce.py)."""
    return None if bucket_mb == DDP_DEFAULT_BUCKET_MB else bucket_mb


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
    # DDP waits on the hook's futures inside its own backward: the log cannot time that wait.
    exposed_comm_measured = False
    breakdown_note = DDP_NOTE

    def __init__(self, model, optimizer_factory, dp_comm: Communicator, bucket_mb: float, comm_dtype: str = "fp32"):
        ddp = DDP(
            model,
            process_group=dp_comm.group,
            bucket_cap_mb=ddp_bucket_cap_mb(bucket_mb),
            # The model is built identically from one seed on every rank; skipping DDP's
            # initial parameter broadcast keeps all traffic inside the communication log.
            # (The GPT has no buffers, so DDP has none to broadcast in forward either.)
            init_sync=False,
        )
        if comm_dtype == "bf16":
            ddp.register_comm_hook(dp_comm.group, counted_bf16_compress_hook(dp_comm))
        else:
            ddp.register_comm_hook(None, _counted_allreduce_hook(dp_comm))
        super().__init__(ddp, optimizer_factory(ddp.module), loss_comm=dp_comm)

    def microbatch_context(self, last_microbatch: bool):
        # DDP's own way of accumulating without communicating.
        return contextlib.nullcontext() if last_microbatch else self.model.no_sync()

    def load_full_state(self, model_state: dict[str, torch.Tensor], optim_state: dict) -> None:
        super().load_full_state(model_state, optim_state)
        self.rebuild_buckets_as_after_a_step()

    def rebuild_buckets_as_after_a_step(self) -> None:
        """Let DDP lay out its buckets as it does after its first step, before a resumed run's first.

        DDP's first backward fills buckets in parameter order; from the next forward on, its
        Reducer (once per process) uses the order in which gradients arrived instead. The flat
        buffer then differs, so gloo's ring cuts it into other chunks and adds each element's
        partial sums in another order: a run resumed at step k would sum step k's gradients with
        the first layout where the uninterrupted run used the rebuilt one, and drift in the last
        bits from step k + 1 on. One backward of a batch of zeros (collective: its all-reduce is
        traffic outside the steps), its gradients then dropped, makes the resumed run's buckets
        those of the uninterrupted run."""
        config = self.model.module.config
        tokens = torch.zeros((1, config.seq_len), dtype=torch.long, device=next(self.model.parameters()).device)
        self.forward_loss(Batch(tokens, tokens), global_tokens=tokens.numel()).backward()
        self.zero_grad()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.module.state_dict().items()}

    def named_full_parameters(self):
        return self.model.module.named_parameters()  # without DDP's "module." prefix

    def full_grads(self) -> dict:
        return {"grads": {n: p.grad.detach().cpu().clone() for n, p in self.model.module.named_parameters()},
                "tp_replica_max_diff": {}}


class AccelerateDDP(Strategy):
    """Hugging Face accelerate's `Accelerator` under torchrun: what most training scripts use.

    `Accelerator` reads the torchrun environment, finds the process group already initialised
    (parallel/dist/groups.py made it) and `prepare` wraps the model in DDP, the optimizer in its
    AcceleratedOptimizer. Our comm hook is registered on that DDP so every bucket is counted, and
    gradients are summed as in TorchDDP (each microbatch loss is already divided by the global
    token count). Accumulation uses `accelerator.no_sync`, the backward `accelerator.backward`.

    Unlike TorchDDP, accelerate keeps DDP's initial parameter broadcast (init_sync): it runs once
    in `prepare`, before the first step, so it is outside every step's traffic (and moves nothing
    new: every rank built the same model from the same seed).
    """

    name = "accelerate_ddp"
    exposed_comm_measured = False  # as TorchDDP: the waits happen inside DDP
    breakdown_note = DDP_NOTE

    def __init__(self, model, optimizer_factory, dp_comm: Communicator, bucket_mb: float, device: torch.device):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        self.accelerator = Accelerator(
            cpu=device.type == "cpu",
            kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=bucket_mb)],
        )
        optimizer = optimizer_factory(model)
        self.adamw = optimizer  # the project's AdamW, inside accelerate's AcceleratedOptimizer
        ddp, optimizer = self.accelerator.prepare(model, optimizer)
        if not isinstance(ddp, DDP):
            raise RuntimeError(f"accelerate did not wrap the model in DDP (got {type(ddp).__name__}): "
                               "launch accelerate_ddp under torchrun with at least 2 processes")
        ddp.register_comm_hook(None, _counted_allreduce_hook(dp_comm))
        super().__init__(ddp, optimizer, loss_comm=dp_comm)

    def microbatch_context(self, last_microbatch: bool):
        return contextlib.nullcontext() if last_microbatch else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)  # accelerate's entry point (loss scaling, its hooks)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.accelerator.unwrap_model(self.model).state_dict().items()}

    def named_full_parameters(self):
        return self.accelerator.unwrap_model(self.model).named_parameters()  # without DDP's "module." prefix

    # Checkpoints go through the project's AdamW: accelerate's wrapper has no named state of its own.
    def full_optimizer_state(self) -> dict:
        return self.adamw.named_state(self.named_full_parameters())

    @torch.no_grad()
    def load_full_state(self, model_state: dict, optim_state: dict) -> None:
        named = list(self.named_full_parameters())
        for name, p in named:
            p.copy_(model_state[name])
        self.adamw.load_named_state(named, optim_state)

    def full_grads(self) -> dict:
        module = self.accelerator.unwrap_model(self.model)
        return {"grads": {n: p.grad.detach().cpu().clone() for n, p in module.named_parameters()},
                "tp_replica_max_diff": {}}
