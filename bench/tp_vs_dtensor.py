"""Hand-written Megatron `tp` against PyTorch's DTensor tensor parallelism, in one run.

    torchrun --standalone --nproc-per-node 2 bench/tp_vs_dtensor.py                 # small model, tp 2
    torchrun --standalone --nproc-per-node 4 bench/tp_vs_dtensor.py rounds=3        # tp 4
    torchrun --standalone --nproc-per-node 2 bench/tp_vs_dtensor.py model=tiny vocab=replicated

Both variants live in the same processes and take turns (round-robin with a rotating start,
`steps` steps each per round), so machine noise and drift fall on both alike. Each variant's step
time is the median over its timed steps of the slowest rank; the printed ratio compares medians
measured in this one run. Variants:

    tp         parallel/tp_strategy.py's TensorParallel, built as parallel/train.py builds it
               (communication log on, the project default)
    torch_tp   GPT(cfg, seed), then torch.distributed.tensor.parallel.parallelize_module on the
               tp sub-mesh: ColwiseParallel for each block's attn.q/k/v and mlp.fc, RowwiseParallel
               for attn.proj and mlp.proj; loss = token_loss_sum(full logits) / global tokens;
               optimizer = parallel.strategy.make_optimizer on the DTensor parameters

The vocabulary (option vocab=...):

    parallel    (default; torchtitan's plan without loss_parallel) embed.tok RowwiseParallel
                (vocab-sharded table, output all-reduced), head.out ColwiseParallel with
                output_layouts=Replicate() (logits all-gathered, then the plain full loss)
    replicated  embed and head left as plain replicated modules (no vocabulary collectives)

With shared_qkv=true a third variant, torch_tp_sq, adds PrepareModuleInput(Replicate ->
Replicate, use_local_output=False) on each block's attn, so q, k and v share one DTensor input and
its gradient is all-reduced once per layer as in Megatron (plain torch_tp all-reduces it three
times, once per ColwiseParallel input).

The hand-written tp always splits the vocabulary and uses the vocab-parallel loss (3 small
all-reduces instead of gathering the logits).

Scope: dp = 1 only (tp = world size, set by default), no sequence parallelism, no pipeline.

Correctness check: before timing, each variant runs steps 0, 1, 2 on the same global batches from
the same seed; their losses are printed side by side and must agree to ~1e-5 relative. One of
those steps (step 2) is also run under a dispatcher mode that counts every collective (c10d and
functional), so the collectives each variant issues per step are printed next to each other (for
tp, also as its communication log recorded them).

Options are Hydra-style key=value overrides of the training config (model=..., train.global_batch=...,
parallel.microbatches=...), plus rounds=N, steps=N, vocab=parallel|replicated and shared_qkv=true|false
for the benchmark.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.comm import calls_by_tag_op
from parallel.data import GlobalBatches, local_microbatches
from parallel.dims import LayoutError
from parallel.distributed import LaunchEnv
from parallel.model import GPT
from parallel.plan import ConfigError
from parallel.strategy import Strategy, make_optimizer
from parallel.tp_strategy import TensorParallel

from harness import plan_for, refuse, rotation, run_distributed, split_args, timed_step

CHECK_STEPS = 3  # steps 0..2 run by every variant on the same data, for the loss check
COUNT_STEP = 2  # the check step that is also run under CommDebugMode
VOCAB_MODES = ("parallel", "replicated")


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = split_args(sys.argv[1:], {"rounds": "5", "steps": "4", "vocab": "parallel", "shared_qkv": "false"})
    vocab, shared_qkv = opts["vocab"], opts["shared_qkv"].lower() in ("1", "true", "yes")
    if vocab not in VOCAB_MODES:
        refuse(env, f"vocab={vocab!r} is not one of {', '.join(VOCAB_MODES)}")
    try:
        # dp = 1: tp takes the whole world unless overridden (and then refused below).
        plan = plan_for(env, ["model=small", "parallel=tp", f"parallel.tp={env.world_size}"], overrides)
    except (ConfigError, LayoutError, ValueError) as e:
        refuse(env, str(e))
    if plan.strategy != "tp" or plan.dims.dp != 1 or plan.dims.pp != 1 or plan.sequence_parallel or plan.dims.tp < 2:
        refuse(env, f"this benchmark compares plain tp with dp = 1 and tp = world size >= 2, got parallel={plan.strategy} "
                    f"dp {plan.dims.dp} x tp {plan.dims.tp} x pp {plan.dims.pp}, sequence_parallel={plan.sequence_parallel}: "
                    "launch with torchrun --nproc-per-node 2 or 4 and leave parallel.* layout overrides out")
    run_distributed(env, plan, lambda plan, ctx, corpus: run(plan, ctx, corpus, int(opts["rounds"]), int(opts["steps"]),
                                                             vocab, shared_qkv))


# -- the DTensor variant ----------------------------------------------------------------------------
def torch_tp_plan(n_layers: int, vocab: str, shared_qkv: bool = False) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = {}
    for i in range(n_layers):
        if shared_qkv:
            # Make attention's input a Replicate DTensor once: q, k and v then share it, their input
            # gradients add up as Partial and are all-reduced once (Megatron's f), not three times.
            plan[f"blocks.{i}.attn"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                          desired_input_layouts=(Replicate(),), use_local_output=False)
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    if vocab == "parallel":
        # torchtitan's plan for a Llama's tok_embeddings and output, minus loss_parallel (the loss
        # here is the plain cross-entropy on full logits).
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate())
        plan["head.out"] = ColwiseParallel(output_layouts=Replicate())
    return plan


class TorchTP(Strategy):
    """The base Strategy's step (forward, token_loss_sum / global tokens, backward, optimizer) on
    a DTensor-parallelized GPT. dp = 1, so there is no gradient sync and the loss needs no reduce."""

    name = "torch_tp"

    def __init__(self, model: nn.Module, tp_mesh, vocab: str, lr: float, weight_decay: float, shared_qkv: bool = False):
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, torch_tp_plan(len(model.blocks), vocab, shared_qkv))
        super().__init__(model, make_optimizer(model, lr, weight_decay), loss_comm=None)


class CountCollectives(TorchDispatchMode):
    """Counts the collectives issued on plain tensors (c10d and functional collectives), by op,
    with their payload bytes. Ops on DTensor are let through first (NotImplemented), so DTensor
    desugars them into local ops and collectives, which come back here: the same trick as
    torch's CommDebugMode, whose module tracker fails on this model (IndexError in
    _fw_set_module_hook, torch 2.13)."""

    NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_c10d_functional_autograd")

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.payload: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented
        name = func._opname.rstrip("_")
        if func.namespace in self.NAMESPACES and not any(w in name for w in ("wait", "wrap")):
            self.calls[name] += 1
            tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if tensors:
                # The project's payload convention: the full tensor (an all-gather's output).
                group = args[1] if "all_gather" in name and len(args) > 1 and isinstance(args[1], int) else 1
                self.payload[name] += tensors[0].numel() * tensors[0].element_size() * group
        return func(*args, **kwargs)


def counted_step(strategy: Strategy, mbs, global_tokens: int):
    """One step under CountCollectives: every collective of forward, backward and optimizer."""
    mode = CountCollectives()
    with mode:
        loss = strategy.train_step(mbs, global_tokens)
    return loss, mode


# -- the benchmark ------------------------------------------------------------------------------------
def run(plan, ctx, corpus, rounds: int, steps: int, vocab: str, shared_qkv: bool) -> None:
    def fresh_model():
        return GPT(plan.model, seed=plan.seed).to(ctx.device)

    def optimizer_for(m):
        return make_optimizer(m, plan.lr, plan.weight_decay)

    m1, m2 = fresh_model(), fresh_model()
    variants = {
        # As parallel/train.py's build_strategy builds parallel=tp.
        "tp": TensorParallel(m1, optimizer_for, ctx.comm("tp"), ctx.comm("dp"), plan.sequence_parallel,
                             plan.grad_sync, plan.bucket_mb),
        "torch_tp": TorchTP(m2, ctx.mesh["tp"], vocab, plan.lr, plan.weight_decay),
    }
    if shared_qkv:
        m3 = fresh_model()
        variants["torch_tp_sq"] = TorchTP(m3, ctx.mesh["tp"], vocab, plan.lr, plan.weight_decay, shared_qkv=True)
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)

    def microbatches(step):
        glob = batches(step)
        return glob, [mb.to(ctx.device) for mb in local_microbatches(glob, ctx.coords["dp"], plan.dims.dp, plan.microbatches)]

    # Correctness first: the same steps 0..2, same data, from the same seed, for every variant.
    check_losses: dict[str, list[float]] = {name: [] for name in variants}
    collectives: dict[str, CountCollectives] = {}
    logged_tp: Counter = Counter()
    for name, strategy in variants.items():
        for step in range(CHECK_STEPS):
            glob, mbs = microbatches(step)
            ctx.log.begin_step()
            if step == COUNT_STEP:
                local_loss, collectives[name] = counted_step(strategy, mbs, glob.n_tokens)
            else:
                local_loss = strategy.train_step(mbs, glob.n_tokens)
            traffic = ctx.log.end_step()
            if name == "tp" and step == COUNT_STEP:
                for ops in calls_by_tag_op(traffic).values():
                    logged_tp.update(ops)
            check_losses[name].append(strategy.global_loss(local_loss))

    times: dict[str, list[float]] = {name: [] for name in variants}
    step = CHECK_STEPS
    names = list(variants)
    for r in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for name in rotation(names, r):
            strategy = variants[name]
            for _ in range(steps):
                glob, mbs = microbatches(step)
                seconds, _, _ = timed_step(ctx, lambda: strategy.train_step(mbs, glob.n_tokens))
                if r > 0 and ctx.is_rank0:
                    times[name].append(seconds)
                step += 1
    for strategy in variants.values():
        strategy.close()
    if ctx.is_rank0:
        report(plan, times, rounds, steps, vocab, check_losses, collectives, logged_tp)


def report(plan, times, rounds, steps, vocab, check_losses, collectives, logged_tp) -> None:
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = plan.tokens_per_step
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} heads={plan.model.n_heads} "
          f"seq={plan.model.seq_len} | world {plan.dims.world_size} = dp 1 x tp {plan.dims.tp} | "
          f"global batch {plan.global_batch} x {plan.microbatches} microbatch(es) | torch_tp vocab={vocab} | "
          f"{rounds} rounds x {steps} steps per variant (medians of the slowest rank)")
    print(f"{'variant':<12} {'step ms':>9} {'tokens/s':>10}")
    for name, seconds in med.items():
        print(f"{name:<12} {seconds * 1e3:9.1f} {tokens / seconds:10.0f}")
    print(f"\ntp / torch_tp tokens/s ratio: {med['torch_tp'] / med['tp']:.3f}  (>1: hand-written tp is faster)")
    if "torch_tp_sq" in med:
        print(f"tp / torch_tp_sq tokens/s ratio: {med['torch_tp_sq'] / med['tp']:.3f}")

    others = [n for n in check_losses if n != "tp"]
    print(f"\nloss check, steps 0..{CHECK_STEPS - 1} on the same data from seed {plan.seed} (rel diff: largest vs tp):")
    print(f"{'step':>4} {'tp':>12} " + " ".join(f"{n:>12}" for n in others) + f" {'rel diff':>10}")
    worst = 0.0
    for i, ref in enumerate(check_losses["tp"]):
        row = [check_losses[n][i] for n in others]
        rel = max(abs(ref - x) / abs(ref) for x in row)
        worst = max(worst, rel)
        print(f"{i:>4} {ref:12.7f} " + " ".join(f"{x:12.7f}" for x in row) + f" {rel:10.2e}")
    print(f"largest relative difference {worst:.2e}: {'OK (<= 1e-5)' if worst <= 1e-5 else 'MISMATCH (> 1e-5)'}")

    print(f"\ncollectives per rank in one step ({plan.microbatches} microbatch(es); forward, backward, optimizer; "
          "counted at the dispatcher):")
    for name, mode in collectives.items():
        detail = ", ".join(f"{n} {op} ({mode.payload[op] / 1e6:.2f} MB)" for op, n in sorted(mode.calls.items()))
        print(f"  {name:<12} {sum(mode.calls.values()):4d} calls, {sum(mode.payload.values()) / 1e6:7.2f} MB payload: {detail}")
    print(f"  (tp's communication log for the same step: {', '.join(f'{n} {op}' for op, n in sorted(logged_tp.items()))})")


if __name__ == "__main__":
    main()
