"""A new pipeline schedule is one record: `gpipe_lifo` is written and registered here, and trained by
the project's own entry point, `launch.train`, with no other file of the project changed:

    torchrun --standalone --nproc-per-node 2 tests/helpers/custom_schedule.py parallel=pp_gpipe \
        parallel.schedule=gpipe_lifo

`gpipe_lifo` is GPipe with its backwards in reverse order (the last microbatch's first, as a
stack would pop them): every forward, then the backwards m-1 .. 0. Its record gives no
closed-form bubble, so the run reports "no closed form" beside the simulated and measured ones,
and no PyTorch class, so torch_pp refuses it. The module registers it when run;
tests/unit/test_pp_schedules.py imports the record and registers it for the length of a test;
tests/runs/test_pp.py runs this script against the single-process run.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code

from parallel.pp.placement import Placement  # noqa: E402
from parallel.pp.schedules import B, F, Schedule, compute_only, gpipe, register_schedule, with_comm  # noqa: E402


def gpipe_lifo(stages: int, microbatches: int, virtual: int = 1):
    """GPipe's forwards, then its backwards last microbatch first (GPipe's refusals: one chunk per rank)."""
    plans = []
    for rank, actions in enumerate(gpipe(stages, microbatches, virtual)):
        compute = compute_only(actions)
        backwards = [a for a in compute if a.op == B][::-1]
        plans.append(with_comm([a for a in compute if a.op == F] + backwards, rank, Placement(stages, 1)))
    return plans


GPIPE_LIFO = Schedule("gpipe_lifo", gpipe_lifo)  # the loop placement; no closed form, no torch class

if __name__ == "__main__":
    register_schedule(GPIPE_LIFO)  # in every worker torchrun starts, before the entry point reads the config
    from launch.train import cli

    cli()
