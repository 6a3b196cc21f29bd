"""One process, one rank, a real process group: every communication call and every strategy's
steps on the device, each checked against the single run.

    python -m launch.gpu_selfcheck --backend nccl      # on a GPU machine (launch/gpu_check.sh runs it)
    python -m launch.gpu_selfcheck --backend gloo      # the same checks on the CPU (its --dry-run)

Why one rank. NCCL refuses two ranks on one GPU, and most machines that have a GPU have one. A
one-rank group still runs each collective through the backend on the device's tensors: a CPU
tensor handed to an NCCL group, a dtype NCCL does not take or a call the backend does not
implement fails here as it would at world 8. And every strategy is built over one-rank groups as
itself, on the layout with every dimension 1, which the route table would otherwise turn into the
single run (a dimension over one rank cuts nothing, parallel/compose/route.py): its model on the
device, its buffers, casts and streams, and the calls it still makes over one rank (some skip a
call one rank makes pointless: each line says how many went through the backend), so its losses
must equal the single run's. What one rank cannot show is anything between two devices: the
bytes that cross, two ranks' posting order, a peer that hangs. Those are the 2-GPU steps of
launch/gpu_check.sh.

Prints one line per check (`ok` or `FAIL`, what it ran, its figures) and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from launch.config import CONFIG_DIR
from launch.gpu_selfcheck_calls import check_calls
from parallel.compare.rows import LOSS_RTOL, max_rel_diff
from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.model import GPT
from parallel.dist.comm import CommLog, Communicator
from parallel.dist.dims import DERIVED_DIMS
from parallel.dist.groups import DistContext, LaunchEnv, add_layout_groups, exit_process, nccl_failure_env
from parallel.registry import SINGLE, parse_options
from parallel.run_plan import RunPlan, build_plan

# Every dimension at one rank; a pipeline preset keeps its microbatches (dualpipev needs 2p of them).
ONE_RANK = ["parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.ep=1"]
# What one process cannot run, and why (the 2-GPU steps of launch/gpu_check.sh run them).
NOT_AT_ONE_RANK = {
    "accelerate_ddp": "accelerate wraps the model in DDP only under torchrun with 2 or more processes",
}


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def one_rank_plan(preset: str, common: list[str], ctx: DistContext | None = None) -> RunPlan:
    """The plan of `preset` with every dimension 1, kept as its own entry: the single run's plan
    (the validator routes a one-rank layout there) given the preset's entry, options and microbatches,
    and `ctx`'s backend and device (a one-rank plan has neither: one process makes no group)."""
    wanted = compose_config([*common, f"parallel={preset}", *ONE_RANK])
    single = build_plan(compose_config([*common, "parallel=single"]), LaunchEnv(), cuda_available=False)
    microbatches = wanted.parallel.microbatches
    layout = dataclasses.replace(single.layout, options=parse_options(wanted.parallel), microbatches=microbatches,
                                 microbatch_size=single.global_batch // microbatches)
    on = {} if ctx is None else {"backend": ctx.backend, "device_type": ctx.device.type}
    return dataclasses.replace(single, strategy=wanted.parallel.name, layout=layout, **on)


def one_rank_context(backend: str, device: torch.device, log: CommLog) -> DistContext:
    """A one-rank default group on `backend` (an in-process store: nothing to rendezvous with), its
    mesh of one-rank dimensions, and the derived groups (ep, edp, dp_cp) every entry may ask for."""
    if backend == "nccl":
        os.environ.update(nccl_failure_env())  # as a run's groups are made (parallel/dist/groups.py)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if backend == "nccl" else None)
    single = one_rank_plan(SINGLE.name, ["model=tiny"])
    ctx = add_layout_groups(DistContext(env=LaunchEnv(), dims=single.dims, backend=backend, device=device, log=log))
    for name in DERIVED_DIMS:
        if ctx.comm(name) is None:
            ctx.comms[name] = Communicator(name, dist.new_group([0]), log)
    return ctx


def train_losses(plan: RunPlan, ctx: DistContext, steps: int) -> tuple[list[float], int]:
    """The losses of `steps` steps of `plan`'s strategy on `ctx`'s device, and the calls it made."""
    strategy = plan.spec.build(GPT(plan.model, seed=plan.seed).to(ctx.device), plan, ctx)
    corpus = load_corpus(plan.data_path, plan.data_max_bytes, plan.model.seq_len + 1)
    batches = GlobalBatches(corpus, plan.model.seq_len, plan.global_batch, plan.seed)
    losses, calls = [], 0
    for step in range(steps):
        batch = batches(step)
        microbatches = [mb.to(ctx.device) for mb in local_microbatches(batch, 0, 1, plan.microbatches)]
        ctx.log.begin_step()
        local = strategy.train_step(microbatches, batch.n_tokens)
        losses.append(strategy.global_loss(local))
        calls += sum(totals.calls for totals in ctx.log.end_step().values())
    strategy.close()
    return losses, calls


def check_strategies(ctx: DistContext, common: list[str], steps: int, only: list[str] | None) -> list[bool]:
    """Each preset's losses on one rank against the single run's, one line each."""
    reference, _ = train_losses(one_rank_plan(SINGLE.name, common, ctx), ctx, steps)
    presets = sorted(p.stem for p in (Path(CONFIG_DIR) / "parallel").glob("*.yaml"))
    results = []
    for preset in presets if only is None else only:
        if preset == SINGLE.name or preset in NOT_AT_ONE_RANK:
            if preset in NOT_AT_ONE_RANK:
                print(f"skip strategy {preset}: {NOT_AT_ONE_RANK[preset]}", flush=True)
            continue
        try:
            losses, calls = train_losses(one_rank_plan(preset, common, ctx), ctx, steps)
            diff = max_rel_diff(losses, reference)
            ok = diff <= LOSS_RTOL
            print(f"{'ok  ' if ok else 'FAIL'} strategy {preset}: {steps} steps, {calls} calls through the backend, "
                  f"losses within {diff:.1e} of single (tolerance {LOSS_RTOL:.0e})", flush=True)
        except Exception as e:  # noqa: BLE001 - one line per strategy, then the next
            ok = False
            print(f"FAIL strategy {preset}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}")
            traceback.print_exc(file=sys.stderr)
        results.append(ok)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    parser.add_argument("--model", default="tiny", help="a conf/model preset (default tiny)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--strategies", nargs="*", help="presets to check (default: every one)")
    args = parser.parse_args(argv)
    if args.backend == "nccl" and not torch.cuda.is_available():
        print("FAIL nccl: no CUDA device is visible (run --backend gloo for the CPU dry run)")
        return 1
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    ctx = one_rank_context(args.backend, device, CommLog())
    results = check_calls(ctx.comm("world"), device)
    results += check_strategies(ctx, [f"model={args.model}"], args.steps, args.strategies)
    failed = results.count(False)
    print(f"{'ok  ' if not failed else 'FAIL'} gpu_selfcheck on {args.backend} ({device}): "
          f"{len(results) - failed} of {len(results)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    exit_process(code)  # past gloo's finalisation (parallel/dist/groups.py)
