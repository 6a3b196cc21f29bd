"""Hand-written Megatron `tp` against PyTorch's DTensor tensor parallelism, in one run.

    torchrun --standalone --nproc-per-node 2 -m bench.tp_vs_dtensor                 # small model, tp 2
    torchrun --standalone --nproc-per-node 4 -m bench.tp_vs_dtensor rounds=3        # tp 4
    torchrun --standalone --nproc-per-node 2 -m bench.tp_vs_dtensor model=tiny vocab=replicated

The variants take turns in the same processes (bench/harness.py: `alternate`):

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

import sys

from bench import harness
from parallel.baselines.dtensor_tp import TorchTP
from parallel.core.model import GPT
from parallel.dist.comm import summarize_traffic
from parallel.dist.dims import LayoutError
from parallel.dist.groups import LaunchEnv
from parallel.run_plan import ConfigError
from parallel.strategy import make_optimizer
from parallel.sync.options import SyncOptions
from parallel.tp.options import TPOptions
from parallel.tp.strategy import TensorParallel

CHECK_STEPS = 3  # steps 0..2 run by every variant on the same data, for the loss check
COUNT_STEP = 2  # the check step whose collectives are printed
VOCAB_MODES = ("parallel", "replicated")


def main() -> None:
    env = LaunchEnv.from_environ()
    overrides, opts = harness.split_args(sys.argv[1:],
                                         {"rounds": "5", "steps": "4", "vocab": "parallel", "shared_qkv": "false"})
    vocab, shared_qkv = opts["vocab"], opts["shared_qkv"].lower() in ("1", "true", "yes")
    if vocab not in VOCAB_MODES:
        harness.refuse(env, f"vocab={vocab!r} is not one of {', '.join(VOCAB_MODES)}")
    try:
        # dp = 1: tp takes the whole world unless overridden (and then refused below).
        plan = harness.plan_for(env, ["model=small", "parallel=tp", f"parallel.tp={env.world_size}"], overrides)
    except (ConfigError, LayoutError, ValueError) as e:
        harness.refuse(env, str(e))
    tp_options = plan.layout.of(TPOptions)
    if plan.strategy != "tp" or plan.dims.dp != 1 or plan.dims.pp != 1 or tp_options.sequence_parallel \
            or plan.dims.tp < 2:
        harness.refuse(env, "this benchmark compares plain tp with dp = 1 and tp = world size >= 2, "
                       f"got parallel={plan.strategy} dp {plan.dims.dp} x tp {plan.dims.tp} x pp {plan.dims.pp}, "
                       f"sequence_parallel={tp_options.sequence_parallel}: "
                       "launch with torchrun --nproc-per-node 2 or 4 and leave parallel.* layout overrides out")
    rounds, steps = int(opts["rounds"]), int(opts["steps"])
    harness.run_distributed(env, plan,
                            lambda plan, ctx, corpus: run(plan, ctx, corpus, rounds, steps, vocab, shared_qkv))


def build(plan, ctx, vocab: str, shared_qkv: bool) -> dict:
    """The variants, each as parallel/train.py builds parallel=tp and parallel=torch_tp."""
    def fresh_model():
        return GPT(plan.model, seed=plan.seed).to(ctx.device)

    def optimizer_for(m):
        return make_optimizer(m, plan.lr, plan.weight_decay)

    tp_comm, dp_comm, mesh = ctx.comm("tp"), ctx.comm("dp"), ctx.mesh["tp"]
    variants = {
        "tp": TensorParallel(fresh_model(), optimizer_for, tp_comm, dp_comm, plan.layout.of(TPOptions),
                             plan.layout.of(SyncOptions)),
        "torch_tp": TorchTP(fresh_model(), optimizer_for, mesh, tp_comm, dp_comm, ctx.log, vocab),
        # The same without the counter: what counting DTensor's collectives costs.
        "torch_tp_uncounted": TorchTP(fresh_model(), optimizer_for, mesh, tp_comm, dp_comm, None, vocab),
    }
    if shared_qkv:
        variants["torch_tp_sq"] = TorchTP(fresh_model(), optimizer_for, mesh, tp_comm, dp_comm, ctx.log, vocab,
                                          shared_qkv=True)
    return variants


def check(ctx, variants: dict, batch) -> tuple[dict, dict]:
    """Correctness first: the same steps 0..2, same data, from the same seed, for every variant.
    Returns each variant's losses and (but the uncounted one's) its collectives of COUNT_STEP."""
    losses: dict[str, list[float]] = {name: [] for name in variants}
    collectives: dict[str, dict] = {}  # variant -> op -> Totals of one step, this rank
    for name, strategy in variants.items():
        for step in range(CHECK_STEPS):
            ctx.log.begin_step()
            local_loss = batch.of(strategy, step)()
            traffic = ctx.log.end_step()
            if step == COUNT_STEP and name != "torch_tp_uncounted":
                collectives[name] = summarize_traffic(traffic)["by_op"]
            losses[name].append(strategy.global_loss(local_loss))
    return losses, collectives


def run(plan, ctx, corpus, rounds: int, steps: int, vocab: str, shared_qkv: bool) -> None:
    variants = build(plan, ctx, vocab, shared_qkv)
    batch = harness.Steps(plan, ctx, corpus)
    losses, collectives = check(ctx, variants, batch)
    timings, _ = harness.alternate(ctx, variants, batch, rounds, steps, first_step=CHECK_STEPS)
    for strategy in variants.values():
        strategy.close()
    if ctx.is_rank0:
        report(plan, timings, rounds, steps, vocab)
        print_losses(plan, losses)
        print_collectives(plan, collectives)


def report(plan, timings, rounds: int, steps: int, vocab: str) -> None:
    print(f"\nmodel d_model={plan.model.d_model} layers={plan.model.n_layers} heads={plan.model.n_heads} "
          f"seq={plan.model.seq_len} | world {plan.dims.world_size} = dp 1 x tp {plan.dims.tp} | "
          f"global batch {plan.global_batch} x {plan.microbatches} microbatch(es) | torch_tp vocab={vocab}\n"
          f"{harness.timing_note(rounds, steps)}")
    harness.print_timings(timings, plan.tokens_per_step, width=18)
    print()
    harness.print_ratio(timings, "tp", "torch_tp")
    counted, uncounted = timings.median("torch_tp"), timings.median("torch_tp_uncounted")
    print(f"counting DTensor's collectives: {100 * (counted / uncounted - 1):+.1f}% "
          "torch_tp step time (an A/B of medians: within the noise of the machine if small)")
    if "torch_tp_sq" in timings.seconds:
        harness.print_ratio(timings, "tp", "torch_tp_sq")


def print_losses(plan, losses: dict[str, list[float]]) -> None:
    others = [n for n in losses if n != "tp"]
    print(f"\nloss check, steps 0..{CHECK_STEPS - 1} on the same data from seed {plan.seed} (rel diff: largest vs tp):")
    print(f"{'step':>4} {'tp':>12} " + " ".join(f"{n:>12}" for n in others) + f" {'rel diff':>10}")
    worst = 0.0
    for i, ref in enumerate(losses["tp"]):
        row = [losses[n][i] for n in others]
        rel = max(abs(ref - x) / abs(ref) for x in row)
        worst = max(worst, rel)
        print(f"{i:>4} {ref:12.7f} " + " ".join(f"{x:12.7f}" for x in row) + f" {rel:10.2e}")
    print(f"largest relative difference {worst:.2e}: {'OK (<= 1e-5)' if worst <= 1e-5 else 'MISMATCH (> 1e-5)'}")


def print_collectives(plan, collectives: dict) -> None:
    print(f"\ncollectives per rank in one step ({plan.microbatches} microbatch(es); forward, backward, optimizer; "
          "tp: its communication log; torch_tp: parallel/baselines/counting.py's counter):")
    for name, by_op in collectives.items():
        detail = ", ".join(f"{t.calls} {op} ({t.payload_bytes / 1e6:.2f} MB)" for op, t in sorted(by_op.items()))
        calls, payload = sum(t.calls for t in by_op.values()), sum(t.payload_bytes for t in by_op.values())
        print(f"  {name:<12} {calls:4d} calls, {payload / 1e6:7.2f} MB payload: {detail}")


if __name__ == "__main__":
    main()
