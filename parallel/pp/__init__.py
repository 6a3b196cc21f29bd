"""Pipeline parallelism: schedules as data, the simulator that checks them, the runner that runs them.

  actions.py         the vocabulary: F, B, W and the sends and receives around them
  placement.py       which rank holds which virtual stage (loop or V)
  schedules.py       GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV as lists of actions
  zero_bubble.py     the zero-bubble schedules: backward split into B and W, W moved into the bubbles
  split_backward.py  one chunk's backward in those two halves
  simulator.py       schedules run on given costs, and checked (deadlock-free, every action once)
  split.py           the one GPT cut into pipeline pieces
  executor.py        a schedule run for real over the pp communicator
  timeline.py        what every rank did when: measured bubble beside the simulator's
  rules.py           its refusals (schedule, split, the recipe's dp sync; why it refuses MoE)
  theory.py          its closed forms: the p2p bytes per step from the placement alone, the saved
                     activations walked along each rank's list (a schedule's bubble is in its record)

There is no strategy file here: the strategy `pp` is the recipe of parallel/compose/mesh3d.py
with tp = cp = 1 (stages, the runner, a dp sync on top), so its entry is compose's
(parallel/compose/__init__.py). Derivations: docs/theory/pipeline.md.
"""

from __future__ import annotations

# The entries of this family: none of its own (see above).
ENTRIES: tuple = ()
