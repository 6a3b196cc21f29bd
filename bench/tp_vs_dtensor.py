"""Hand-written Megatron `tp` against PyTorch's DTensor tensor parallelism, in one run.

    torchrun --standalone --nproc-per-node 2 bench/tp_vs_dtensor.py                 # small model, tp 2
    torchrun --standalone --nproc-per-node 4 bench/tp_vs_dtensor.py rounds=3        # tp 4
    torchrun --standalone --nproc-per-node 2 bench/tp_vs_dtensor.py model=tiny vocab=replicated

All variants live in the same processes and take turns (round-robin with a rotating start,
`steps` steps each per round), so machine noise and drift fall on both alike. Each variant's step
time is the median over its timed steps of the slowest rank; the printed ratio compares medians
measured in this one run. Variants:

    tp         parallel/tp/strategy.py's TensorParallel, built as parallel/train.py builds it
               (communication log on, the project default)
    torch_tp   parallel/baselines/dtensor_tp.py's TorchTP, as train.py builds parallel=torch_tp: GPT(cfg,
               seed), then parallelize_module on the tp sub-mesh (ColwiseParallel for each block's
               attn.q/k/v and mlp.fc, RowwiseParallel for attn.proj and mlp.proj); the project's
               loss and optimizer; its collectives counted by parallel/baselines/counting.py
    torch_tp_uncounted  the same without the counter: the cost of counting

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
the same seed; their losses are printed side by side and must agree to ~1e-5 relative. The
collectives each variant issued in step 2 (tp: its communication log; torch_tp: the counter around
DTensor's functional collectives, parallel/baselines/counting.py) are printed next to each other.

Options are Hydra-style key=value overrides of the training config (model=..., train.global_batch=...,
parallel.microbatches=...), plus rounds=N, steps=N, vocab=parallel|replicated and shared_qkv=true|false
for the benchmark.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

from harness import plan_for, refuse, rotation, run_distributed, split_args, timed_step

from parallel.baselines.dtensor_tp import TorchTP
from parallel.core.data import GlobalBatches, local_microbatches
from parallel.core.model import GPT
from parallel.dist.comm import summarize_traffic
from parallel.dist.dims import LayoutError
from parallel.dist.groups import LaunchEnv
from parallel.plan import ConfigError
from parallel.strategy import make_optimizer
from parallel.tp.strategy import TensorParallel

CHECK_STEPS = 3  # steps 0..2 run by every variant on the same data, for the loss check
COUNT_STEP = 2  # the check step whose collectives are printed
VOCAB_MODES = ("parallel", "replicated")


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = split_args(sys.argv[1:],
                                 {"rounds": "5", "steps": "4", "vocab": "parallel", "shared_qkv": "false"})
    vocab, shared_qkv = opts["vocab"], opts["shared_qkv"].lower() in ("1", "true", "yes")
    if vocab not in VOCAB_MODES:
        refuse(env, f"vocab={vocab!r} is not one of {', '.join(VOCAB_MODES)}")
    try:
        # dp = 1: tp takes the whole world unless overridden (and then refused below).
        plan = plan_for(env, ["model=small", "parallel=tp", f"parallel.tp={env.world_size}"], overrides)
    except (ConfigError, LayoutError, ValueError) as e:
        refuse(env, str(e))
    if plan.strategy != "tp" or plan.dims.dp != 1 or plan.dims.pp != 1 or plan.sequence_parallel or plan.dims.tp < 2:
        refuse(env, "this benchmark compares plain tp with dp = 1 and tp = world size >= 2, "
                    f"got parallel={plan.strategy} dp {plan.dims.dp} x tp {plan.dims.tp} x pp {plan.dims.pp}, "
                    f"sequence_parallel={plan.sequence_parallel}: "
                    "launch with torchrun --nproc-per-node 2 or 4 and leave parallel.* layout overrides out")
    run_distributed(env, plan, lambda plan, ctx, corpus: run(plan, ctx, corpus, int(opts["rounds"]), int(opts["steps"]),
                                                             vocab, shared_qkv))


# -- the benchmark ------------------------------------------------------------------------------------
def run(plan, ctx, corpus, rounds: int, steps: int, vocab: str, shared_qkv: bool) -> None:
    def fresh_model():
        return GPT(plan.model, seed=plan.seed).to(ctx.device)

    def optimizer_for(m):
        return make_optimizer(m, plan.lr, plan.weight_decay)

    m1, m2, m3 = fresh_model(), fresh_model(), fresh_model()
    tp_comm, dp_comm = ctx.comm("tp"), ctx.comm("dp")
    variants = {
        # As parallel/train.py's build_strategy builds parallel=tp and parallel=torch_tp.
        "tp": TensorParallel(m1, optimizer_for, tp_comm, dp_comm, plan.sequence_parallel, plan.grad_sync,
                             plan.bucket_mb),
        "torch_tp": TorchTP(m2, optimizer_for, ctx.mesh["tp"], tp_comm, dp_comm, ctx.log, vocab),
        # The same without the counter: what counting DTensor's collectives costs.
        "torch_tp_uncounted": TorchTP(m3, optimizer_for, ctx.mesh["tp"], tp_comm, dp_comm, None, vocab),
    }
    if shared_qkv:
        variants["torch_tp_sq"] = TorchTP(fresh_model(), optimizer_for, ctx.mesh["tp"], tp_comm, dp_comm, ctx.log,
                                          vocab, shared_qkv=True)
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)

    def microbatches(step):
        glob = batches(step)
        return glob, [mb.to(ctx.device)
                      for mb in local_microbatches(glob, ctx.coords["dp"], plan.dims.dp, plan.microbatches)]

    # Correctness first: the same steps 0..2, same data, from the same seed, for every variant.
    check_losses: dict[str, list[float]] = {name: [] for name in variants}
    collectives: dict[str, dict] = {}  # variant -> op -> Totals of one step, this rank
    for name, strategy in variants.items():
        for step in range(CHECK_STEPS):
            glob, mbs = microbatches(step)
            ctx.log.begin_step()
            local_loss = strategy.train_step(mbs, glob.n_tokens)
            traffic = ctx.log.end_step()
            if step == COUNT_STEP and name != "torch_tp_uncounted":
                collectives[name] = summarize_traffic(traffic)["by_op"]
            check_losses[name].append(strategy.global_loss(local_loss))

    times: dict[str, list[float]] = {name: [] for name in variants}
    step = CHECK_STEPS
    names = list(variants)
    for r in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for name in rotation(names, r):
            strategy = variants[name]
            for _ in range(steps):
                glob, mbs = microbatches(step)
                seconds, _, _ = timed_step(ctx, partial(strategy.train_step, mbs, glob.n_tokens))
                if r > 0 and ctx.is_rank0:
                    times[name].append(seconds)
                step += 1
    for strategy in variants.values():
        strategy.close()
    if ctx.is_rank0:
        report(plan, times, rounds, steps, vocab, check_losses, collectives)


def report(plan, times, rounds, steps, vocab, check_losses, collectives) -> None:
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
    print(f"counting DTensor's collectives: {100 * (med['torch_tp'] / med['torch_tp_uncounted'] - 1):+.1f}% "
          "torch_tp step time (an A/B of medians: within the noise of this machine if small)")
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
          "tp: its communication log; torch_tp: parallel/baselines/counting.py's counter):")
    for name, by_op in collectives.items():
        detail = ", ".join(f"{t.calls} {op} ({t.payload_bytes / 1e6:.2f} MB)" for op, t in sorted(by_op.items()))
        calls, payload = sum(t.calls for t in by_op.values()), sum(t.payload_bytes for t in by_op.values())
        print(f"  {name:<12} {calls:4d} calls, {payload / 1e6:7.2f} MB payload: {detail}")


if __name__ == "__main__":
    main()
