"""How well virtual device time (parallel/replay/) matches what runs measure: the validation table.

    python -m bench.virtual_time [checks=stability,loaded,faithful,contention,pipelines,network] [model=tiny]
                                 [steps=8] [repeats=3] [rounds=5] [loopback=sampled|once] [probes=5]
                                 [out=runs/virtual-bench]

Each check makes real runs (bench/virtual_time/runs.py), reads their summary.json, replays some
from their saved events, and sets the virtual clock against a clock that is trustworthy for that
case, or against itself (bench/virtual_time/tables.py):

  stability    dp, tp, pp_1f1b, zero2, torch_ddp at world 4, `repeats` runs each started together:
               virtual tokens/s against its median (the claim: within ±5%)
  loaded       the same while one busy process per core competes for the machine (within ±5%)
  faithful     the same strategies at world 2, a core per rank, `rounds` rounds: the virtual step
               against the wall step, the median of the runs' ratios (within 5%)
  contention   the same at world 4, `repeats` runs each one after another, bound two to a core
               (`train.pin_cores=round_robin`), replayed with each rank on its core: against their
               wall step (within 10%)
  pipelines    every schedule of ours at p 4, m 8: the virtual bubble against the simulator's given
               each stage's measured F, B, W and the messages' costs (within 3 points)
  network      dp, tp, pp_1f1b at world 2, `rounds` pairs made back to back: a loopback run replayed
               onto 200 Mbit/s between 2 nodes, against launch.run on that emulated network (within
               10%; needs root)

The loopback's figures: one probe before the batch (parallel/replay/probe.py's method, each figure
the median of `probes` probe runs) is given to every run (`virtual.loopback_*`), so that the runs
differ only in what they measured. With `loopback=sampled` (the default) one more probe run
precedes every run (but the loaded ones: a probe beside busy processes reads their contention, not
the link), and every run is replayed again on the median of all of them: the loopback's per-call
cost on a small shared host follows the host's moment, and the batch's median is the host's figure
over the time the runs took. Neither is fitted to the runs: both are probes.

Prints the tables and the exact commands it ran, and writes them to <out>/table.md (the probes to
<out>/probes.json).
"""
