"""Run under torchrun at world 4 by test_checkpoint.py: every strategy of the registry checkpoints,
and its checkpoint resumes under another layout as if nothing had happened.

For each preset of PRESETS, in one job (each on its own device mesh over the same 4 processes):
train steps 0..2 under the preset, write a real checkpoint (gathered to rank 0, DCP files,
meta.json), then build the NEXT preset of the list from another seed, load the checkpoint from
disk, train steps 3..5. Its losses and final parameters must equal an uninterrupted
single-process run within 1e-5: the saving strategy's gather and the loading one's cut both
right, Adam's moments included (a dropped moment changes the next steps' updates).

The same again for a mixture of experts (model=tiny_moe) over the strategies that train one
(MOE_PRESETS: expert parallelism at ep = dp and inside dp, and every dense strategy whose
registry entry says moe=True): the experts gathered from their ep ranks and cut again by the
next layout, the routing and dropping of the resumed steps the single run's. Then for Llama's
block (model=tiny_llama) over the strategies that cut it into parts, stages or groups, and with
its head tied to the token table over those that train a tied head.

Prints one line per preset; exits non-zero on the first difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script: the project root must come first on the path (this checkout's code, not an installed one).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from launch.config import CONFIG_DIR
from parallel.baselines import fsdp2
from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.model import GPT
from parallel.dist.comm import CommLog
from parallel.dist.groups import DistContext, LaunchEnv, add_layout_groups, exit_process, init_distributed, shutdown
from parallel.reliability.checkpoint import checkpoint_meta, load_checkpoint, save_checkpoint
from parallel.run_plan import build_plan

# FSDP2's checkpoint gathers its full tensors 64 KiB at a time here, not 64 MiB: the tiny model's state
# (under 1 MB) then takes several all-gathers, and their boundaries are checked against the single run too.
fsdp2.GATHER_BUCKET_BYTES = 64 * 2**10

# Every strategy, ours and PyTorch's, at world 4 (single in one process of its own).
PRESETS = [
    ("single", []), ("dp", []), ("dp_naive", []), ("zero1", []), ("zero2", []), ("zero3", []),
    ("hsdp", []), ("hsdp_zero2", []), ("tp", []), ("tp_sp", []), ("pp_gpipe", []), ("pp_1f1b", ["parallel.dp=2"]),
    ("pp_interleaved", ["parallel.dp=2"]),
    ("pp_zbh1", ["parallel.dp=2", "parallel.zero=2"]), ("pp_zbv", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp_dualpipev", ["parallel.dp=2", "parallel.microbatches=4"]),
    ("3d", ["parallel.microbatches=2"]), ("cp", []), ("cp_a2a", ["parallel.cp=4", "parallel.zero=1"]),
    ("torch_ddp", []), ("accelerate_ddp", []), ("torch_fsdp2", []), ("torch_hsdp", []), ("torch_zero1", []),
    ("torch_zero2", []), ("torch_tp", []), ("torch_pp_gpipe", []), ("torch_pp_1f1b", []),
    ("torch_pp_interleaved", []), ("torch_pp_zbv", []), ("torch_pp_dualpipev", []), ("torch_pp_interleaved_zb", []),
]
# Eight layers, so that torch's interleaved schedule has 4 ranks x 2 chunks to cut.
COMMON = ["model=tiny", "model.n_layers=8", "train.global_batch=16", "data.max_bytes=1000000", "train.steps=6",
          "train.warmup_steps=1"]
# A mixture of experts: every strategy whose registry entry trains one (the others refuse it).
MOE_PRESETS = [
    ("single", []), ("ep", []), ("ep", ["parallel.ep=2"]), ("dp", []), ("zero1", []), ("zero2", []), ("zero3", []),
    ("hsdp", []), ("hsdp_zero2", []), ("torch_ddp", []), ("accelerate_ddp", []), ("torch_fsdp2", []),
    ("torch_hsdp", []), ("torch_zero1", []), ("torch_zero2", []),
]
MOE_COMMON = ["model=tiny_moe", *COMMON[2:]]
# Llama's block (GQA, SwiGLU, RMSNorm, RoPE, no biases): the strategies that cut it in other places
# than a dense GPT-2's (ZeRO's parts, FSDP2's groups, pipeline stages; tp and cp where they train it).
LLAMA_PRESETS = [("single", []), ("zero3", []), ("pp_1f1b", ["parallel.dp=2"]), ("torch_fsdp2", []),
                 ("pp_zbv", ["parallel.dp=2"]), ("torch_pp_1f1b", []), ("hsdp", []), ("dp", [])]
LLAMA_COMMON = ["model=tiny_llama", *COMMON[2:]]
# A head tied to the token table, over the strategies that train one: the checkpoint names the shared
# table twice (embed.tok.weight and head.out.weight), as the single model's state_dict does.
TIED_PRESETS = [("single", []), ("zero1", []), ("zero2", []), ("torch_fsdp2", []), ("torch_zero1", []),
                ("torch_zero2", []), ("hsdp_zero2", []), ("torch_hsdp", []), ("dp", [])]
TIED_COMMON = [*LLAMA_COMMON, "model.tied_head=true"]
SAVE_AT, STEPS = 3, 6


def plan_for(preset: str, extra: list[str], world: int, common: list[str] = COMMON):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*common, f"parallel={preset}", *extra])
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    return build_plan(cfg, env, cuda_available=False)


class Layouts:
    """One device mesh and set of communicators per (dp, tp, pp), over the job's 4 processes, made
    once: PyTorch caches sub-meshes by their ranks and dimension names, so two meshes of one shape
    in one process would hand DTensor the first one's groups."""

    def __init__(self, env: LaunchEnv, base: DistContext):
        self.env, self.base = env, base
        self.contexts: dict = {base.dims: base}

    def context(self, plan) -> DistContext:
        if plan.dims.world_size == 1:  # the single-process strategy: no groups at all
            return DistContext(env=LaunchEnv(), dims=plan.dims, backend=None, device=self.base.device,
                               log=self.base.log)
        if plan.dims not in self.contexts:
            ctx = DistContext(env=self.env, dims=plan.dims, backend=self.base.backend, device=self.base.device,
                              log=self.base.log)
            self.contexts[plan.dims] = add_layout_groups(ctx)
        return self.contexts[plan.dims]


def train(strategy, plan, ctx, batches, steps) -> list[float]:
    losses = []
    for step in steps:
        batch = batches(step)
        local = local_microbatches(batch, ctx.coords["dp"], plan.dims.dp, plan.microbatches)
        losses.append(strategy.global_loss(strategy.train_step(local, batch.n_tokens)))
    return losses


def main() -> None:
    env = LaunchEnv.from_environ()
    torch.set_num_threads(1)
    chains = [(COMMON, PRESETS), (MOE_COMMON, MOE_PRESETS), (LLAMA_COMMON, LLAMA_PRESETS), (TIED_COMMON, TIED_PRESETS)]
    plans = [[(name, plan_for(name, extra, 1 if name == "single" else env.world_size, common))
              for name, extra in presets] for common, presets in chains]
    base = init_distributed(env, plans[0][1][1].dims, "gloo", 60.0, CommLog())
    layouts = Layouts(env, base)
    root = Path(sys.argv[1])
    for chain, chain_plans in zip(("dense", "moe", "llama", "tied"), plans):
        check_chain(chain_plans, layouts, env, root / chain)
    if env.rank == 0:
        print("every strategy checkpoints: ok", flush=True)
    shutdown(base)
    exit_process(0)


def check_chain(plans, layouts: Layouts, env: LaunchEnv, root: Path) -> None:
    """Each plan saves after SAVE_AT steps, the next one resumes; all against one uninterrupted run."""
    first = plans[0][1]
    corpus = load_corpus(None, first.data_max_bytes, first.model.seq_len + 1)
    batches = GlobalBatches(corpus, first.model.seq_len, first.global_batch, first.seed)
    world = layouts.base.comm("world")

    # The uninterrupted reference: one process, six steps (every rank computes it; rank 0 checks).
    reference_plan = first
    reference = reference_plan.spec.build(GPT(reference_plan.model, seed=reference_plan.seed), reference_plan,
                                          layouts.context(reference_plan))
    want_losses = train(reference, reference_plan, layouts.context(reference_plan), batches, range(STEPS))
    want_params = reference.full_state_dict()

    for i, (name, plan) in enumerate(plans):
        ctx = layouts.context(plan)
        saver = plan.spec.build(GPT(plan.model, seed=plan.seed), plan, ctx)
        train(saver, plan, ctx, batches, range(SAVE_AT))
        if isinstance(saver, fsdp2.TorchFSDP2):  # the small bucket above really splits the gather
            assert len(fsdp2.gather_buckets(saver.locals, saver.full_shapes, saver.comm.size)) > 1, name
        model_state, optim_state = saver.full_state_dict(), saver.full_optimizer_state()
        path = root / f"{i}-{name}"
        if env.rank == 0:
            save_checkpoint(path, SAVE_AT, model_state, optim_state, checkpoint_meta(plan, SAVE_AT))
        saver.close()
        world.barrier(tag="tooling/test")

        # Resume under the next preset of the list, built from another seed: everything comes from disk.
        next_name, next_plan = plans[(i + 1) % len(plans)]
        next_ctx = layouts.context(next_plan)
        resumed = next_plan.spec.build(GPT(next_plan.model, seed=next_plan.seed + 1), next_plan, next_ctx)
        model_state, optim_state = load_checkpoint(path / f"step_{SAVE_AT:06d}")
        resumed.load_full_state(model_state, optim_state)
        losses = train(resumed, next_plan, next_ctx, batches, range(SAVE_AT, STEPS))
        params = resumed.full_state_dict()
        resumed.close()
        name, next_name = _label(name, plan), _label(next_name, next_plan)
        if env.rank == 0:
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses[SAVE_AT:]))
            assert diff < 1e-5, f"{name} -> {next_name}: losses {losses} vs {want_losses[SAVE_AT:]} ({diff:.2e})"
            assert params.keys() == want_params.keys(), (name, next_name)
            lr = plan.lr
            for n in want_params:
                # rtol 1e-5, plus an absolute 10% of one lr step. Two layouts sum gradients in
                # different orders, and Adam divides each update by that element's own gradient
                # magnitude: where the true gradient is (nearly) zero the rounding difference sets
                # the update's direction, up to lr per step (seen: 2.7% of lr on 1 of 16384 elements
                # after tp -> tp_sp). A dropped or misplaced Adam moment moves every element by O(lr).
                torch.testing.assert_close(params[n], want_params[n], rtol=1e-5, atol=1e-1 * lr,
                                           msg=lambda m, n=n, a=name, b=next_name: f"{a} -> {b} {n}: {m}")
            print(f"{name} saved at step {SAVE_AT}, {next_name} resumed: losses within {diff:.1e}", flush=True)
        world.barrier(tag="tooling/test")


def _label(name: str, plan) -> str:
    """`ep(ep=2)` where a preset runs twice with another layout; the model's kind where not GPT-2's dense one."""
    label = f"{name}(ep={plan.dims.ep})" if plan.dims.ep > 1 else name
    kind = "moe" if plan.model.moe_experts else "tied" if plan.model.tied_head else "llama" \
        if not plan.model.is_gpt2_shape else ""
    return f"{label} [{kind}]" if kind else label


if __name__ == "__main__":
    main()
