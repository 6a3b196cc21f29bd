"""Train the GPT with one strategy: `python -m launch.train` or under torchrun.

    python -m launch.train                                              # one process
    torchrun --standalone --nproc-per-node 2 -m launch.train parallel=dp
    torchrun --standalone --nproc-per-node 4 -m launch.train parallel=dp_naive parallel.microbatches=2

A configuration error is reported in one line on stderr (by rank 0 only, under torchrun), before
any process group exists, and the process exits with status 2 (torchrun itself then exits 1). A
non-finite loss stops every rank with status 3. Any other failure of a rank (its own exception, or
a peer that died or hung: gloo then raises on this rank) prints the traceback and one `error:`
line naming the rank, and exits 1; torchrun then stops the rest.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from launch.config import CONFIG_DIR, unknown_preset
from parallel.core.data import DataError
from parallel.dist.dims import LayoutError
from parallel.dist.groups import LaunchEnv, exit_process, exit_with_error
from parallel.reliability.checkpoint import CheckpointError
from parallel.reliability.faults import describe_failure
from parallel.reliability.recovery import Journal, note_stopped
from parallel.run_plan import ConfigError, build_plan
from parallel.train import TrainingStopped, train

CONFIG_ERRORS = (ConfigError, LayoutError, DataError, CheckpointError)


_saved_stderr: int | None = None  # the real stderr of a rank > 0 while Hydra parses (see `cli`)


def cli() -> None:
    """The entry point (`python -m launch.train`, `parallel-train`). Under torchrun every rank parses
    the same command line, so a mistake Hydra itself reports (`model=nonexistent`) would be printed
    once per rank: ranks other than 0 keep their stderr closed until Hydra has handed over the
    config, and rank 0 says it once."""
    global _saved_stderr
    unknown = unknown_preset(sys.argv[1:])
    if unknown:
        exit_with_error(LaunchEnv.from_environ(), unknown)
    if int(os.environ.get("RANK", "0")) != 0:
        sys.stderr.flush()
        _saved_stderr = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    main()


def _restore_stderr() -> None:
    global _saved_stderr
    if _saved_stderr is not None:
        sys.stderr.flush()
        os.dup2(_saved_stderr, 2)
        os.close(_saved_stderr)
        _saved_stderr = None


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    _restore_stderr()  # Hydra accepted the command line: from here every rank speaks for itself
    run(cfg, LaunchEnv.from_environ())


def run(cfg: DictConfig, env: LaunchEnv) -> None:
    """One run of a composed config on this rank, and its exit: the body of `main`, which the
    sweep's pool (launch/forkserver.py) also calls, in a fork, on a config it composed itself."""
    timeout_s, plan = cfg.parallel.timeout_s, None
    try:
        plan = build_plan(cfg, env, cuda_available=torch.cuda.is_available())
        train(plan, OmegaConf.to_container(cfg, resolve=True), env)
    except CONFIG_ERRORS as e:
        exit_with_error(env, str(e))
    except TrainingStopped as e:
        # Every rank reached the same verdict at the same step: each says it, and waits a moment
        # before leaving, since torchrun stops every rank as soon as the first one exits.
        print(f"error: {e}" if env.rank == 0 else f"error (rank {env.rank}): {e}", file=sys.stderr, flush=True)
        time.sleep(0.5)
        exit_process(3)
    except Exception as e:
        # A job that resumes by itself notes when the failure reached this rank and when it left:
        # the next attempt's recovery block (parallel/reliability/recovery.py).
        journal = Journal(plan.run_dir, env.rank, plan.attempt) if plan is not None and plan.resume_auto else None
        if journal is not None and not hasattr(e, "detected_at"):  # not stamped where it was caught
            note_stopped(plan.run_dir, env.rank, plan.attempt)
        # Leave at once: a normal interpreter exit would join gloo's threads, which wait out a
        # pending collective's timeout. torchrun sees the failure and stops the other ranks.
        traceback.print_exc()
        print(f"error: {describe_failure(e, env.rank, timeout_s)}", file=sys.stderr, flush=True)
        if journal is not None:
            journal.append("exited")
        exit_process(1)
    if env.world_size > 1:
        # The run is complete and flushed: leave without interpreter finalisation, which can
        # abort a gloo process after its work is done (see parallel/dist/groups.py).
        exit_process(0)


if __name__ == "__main__":
    cli()
