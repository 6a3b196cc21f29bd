"""PyTorch's DTensor tensor parallelism (`parallelize_module`) on the same GPT: the baseline for `tp`.

The plan is torchtitan's for a GPT or Llama block: each block's attention q, k, v and MLP fc (and a
gated MLP's gate: SwiGLU's w1 and w3) are ColwiseParallel, attention and MLP output projections
RowwiseParallel. K and V are cut by whole kv heads, so grouped-query attention needs tp to divide
the kv heads (torchtitan's n_kv_heads % tp == 0; `check_torch_tp_model` refuses the rest, where the
hand-written `tp` replicates them); with vocab="parallel" the
token table is RowwiseParallel (vocabulary rows split, output all-reduced) and the head
ColwiseParallel with output_layouts=Replicate() (logits all-gathered, then the plain full loss;
torchtitan's loss_parallel is not used). Loss, optimizer and data are the project's.

With dp > 1 (a 2-D mesh dp x tp), each rank's local gradient shards are summed over dp in one
all-reduce of one flat buffer after backward, through the communication log: a DDP without
bucketing or overlap, so what is compared over tp is DTensor against Megatron.

What it sends that Megatron does not (see registry.expected_comm("torch_tp") for the exact count):
q, k and v each take the block input as their own Replicate DTensor, so its gradient is
all-reduced three times per layer, not once; the MLP's fc input is all-reduced too, and a gated
MLP's gate input once more (4 per layer backward against Megatron's 2; 5 with SwiGLU); and the
head all-gathers the full logits (b·s·V) where Megatron's vocab-parallel loss all-reduces three b·s
vectors.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.baselines.counting import FunctionalCollectiveCounter
from parallel.core.data import Batch
from parallel.dist.comm import CommLog, Communicator
from parallel.strategy import GradSync, Strategy, storage_bytes


def torch_tp_plan(n_layers: int, vocab: str = "parallel", shared_qkv: bool = False, gated: bool = False) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = {}
    for i in range(n_layers):
        if shared_qkv:
            # Make attention's input a Replicate DTensor once: q, k and v then share it, their input
            # gradients add up as Partial and are all-reduced once (Megatron's f), not three times.
            plan[f"blocks.{i}.attn"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                          desired_input_layouts=(Replicate(),), use_local_output=False)
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc", *(("mlp.gate",) if gated else ())):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    if vocab == "parallel":
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate())
        plan["head.out"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor is its own)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a DTensor is gathered over its mesh)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TorchTP(Strategy):
    name = "torch_tp"

    def __init__(self, model: nn.Module, optimizer_factory, tp_mesh, tp_comm: Communicator,
                 dp_comm: Communicator | None, log: CommLog | None, vocab: str = "parallel", shared_qkv: bool = False):
        from torch.distributed.tensor.parallel import parallelize_module

        plan = torch_tp_plan(len(model.blocks), vocab, shared_qkv, gated=model.config.gated_mlp)
        parallelize_module(model, tp_mesh, plan)
        self._params = dict(model.named_parameters())
        self.dp_comm = dp_comm if dp_comm is not None and dp_comm.size > 1 else None
        params = [p for p in model.parameters() if p.requires_grad]
        sync = FlatDPSync(params, self.dp_comm) if self.dp_comm is not None else None
        super().__init__(model, optimizer_factory(model), loss_comm=dp_comm, sync=sync)
        # DTensor's own collectives are counted where it calls them; the dp sum goes through dp_comm.
        self.counter = ((lambda: FunctionalCollectiveCounter(log, [tp_comm], "dtensor")) if log is not None
                        else contextlib.nullcontext)

    def train_step(self, microbatches: list[Batch], global_tokens: int) -> torch.Tensor:
        phase = self.phases
        phase("other", "zero_grad")
        self.zero_grad()
        local_loss = torch.zeros((), device=microbatches[0].inputs.device)
        with self.counter():
            for i, mb in enumerate(microbatches):
                phase("forward", f"F{i}")
                with self.forward_context():
                    loss = self.forward_loss(mb, global_tokens)
                phase("backward", f"B{i}")
                loss.backward()
                local_loss += loss.detach()
            phase("sync", "gradient placements")
            self._grads_to_parameter_placements()
        self.after_backward()
        phase("other", "finite check")
        self.guard_finite(local_loss)
        phase("optimizer", "optimizer step")
        with self.counter():  # elementwise on same-placement DTensors: no collective expected, but counted if any
            self.optimizer.step()
        return local_loss

    def _grads_to_parameter_placements(self) -> None:
        """DTensor hands the vocabulary-sharded token table its gradient as Replicate (the full V x h
        on every tp rank: the embedding backward's sharding rule). Cutting it to the parameter's own
        Shard(0) is a local slice, no communication, and makes the dp sum and the optimizer work
        on shards (Ψ_t per rank, Megatron's count) instead of the whole table."""
        for p in self.model.parameters():
            g = p.grad
            if g is not None and hasattr(g, "placements") and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)


    def memory_report(self) -> dict:
        """As the base class's, on the local shards (a DTensor has no storage of its own)."""
        params = storage_bytes(_local(p) for p in self.model.parameters())
        grads = storage_bytes(_local(p.grad) for p in self.model.parameters() if p.grad is not None)
        state = storage_bytes(_local(t) for s in self.optimizer.state.values()
                              for t in s.values() if torch.is_tensor(t))
        return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": state,
                "peak_model_state_bytes": params + grads + state}

    def full_parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # a DTensor's numel is the full tensor's

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: _full(v).detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def full_grads(self) -> dict:
        return {"grads": {n: _full(p.grad).detach().cpu().clone() for n, p in self.model.named_parameters()},
                "tp_replica_max_diff": {}}

    # -- checkpoints: whole tensors out, each rank's DTensor shard back in -----------------------
    def full_optimizer_state(self) -> dict:
        local = self.optimizer.named_state(self.model.named_parameters())
        return {"step": local["step"], "state": {n: {k: _full(t).detach().cpu().clone() for k, t in m.items()}
                                                 for n, m in local["state"].items()}}

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The DTensor of this rank's shard of `full`, placed as parameter `name` is (a local slice:
        DTensor's own layout rules give its shape and offset; no communication)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        p = self._params[name]
        if not isinstance(p, DTensor):
            return full
        shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
        piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(p.device, p.dtype).contiguous()
        return DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False)


class FlatDPSync(GradSync):
    """With dp > 1, each rank's local gradient shards summed over dp in one all-reduce of one flat
    buffer after backward: a DDP without bucketing or overlap, so what is compared over tp is
    DTensor against Megatron."""

    def __init__(self, params: list[nn.Parameter], dp_comm: Communicator):
        super().__init__(params)
        self.dp_comm = dp_comm

    def finish(self) -> None:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        self.dp_comm.all_reduce(flat, tag="grads/flat")
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
        self.complete()
