"""Check a training configuration for a multi-node layout before starting anything: launch.train's
own validation (the whole plan, for the world NODES x NPROC gives), plus that parallel.tp divides
the processes per node, so every tensor-parallel group stays on one node's fast links.

    python -m launch.check --nodes 2 --nproc-per-node 4 parallel=tp model=small

Prints nothing and exits 0 when the layout can run; otherwise one `error:` line on stderr, exit 2.
launch/slurm/train.sbatch runs it on the allocation's first node before srun starts any agent.
"""

from __future__ import annotations

import argparse
import sys


def check(nodes: int, nproc_per_node: int, overrides: list[str]) -> str | None:
    """The one-line reason this layout cannot run, or None."""
    from hydra import compose, initialize_config_dir

    from launch.config import CONFIG_DIR, unknown_preset
    from parallel.core.data import DataError
    from parallel.dist.dims import LayoutError
    from parallel.dist.groups import LaunchEnv
    from parallel.reliability.checkpoint import CheckpointError
    from parallel.run_plan import ConfigError, build_plan

    if nodes < 1 or nproc_per_node < 1:
        return f"{nodes} node(s) x {nproc_per_node} process(es) per node: the allocation gives no processes to run"
    unknown = unknown_preset(overrides)
    if unknown:
        return unknown
    import torch

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    world = nodes * nproc_per_node
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=nproc_per_node)
    try:
        plan = build_plan(cfg, env, cuda_available=torch.cuda.is_available())
    except (ConfigError, LayoutError, DataError, CheckpointError) as e:
        return f"{e} ({nodes} nodes x {nproc_per_node} processes = world {world})"
    if nproc_per_node % plan.dims.tp:
        return (f"parallel.tp={plan.dims.tp} does not divide the {nproc_per_node} processes per node: a "
                f"tensor-parallel group would span nodes; choose a tp that divides {nproc_per_node}, or change the "
                "processes per node")
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("overrides", nargs="*", help="launch.train's Hydra overrides")
    args = parser.parse_args(argv)
    error = check(args.nodes, args.nproc_per_node, args.overrides)
    if error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
