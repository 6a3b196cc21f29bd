"""Which parameters make each fragment, and which fragments sync after which step.

Both the strategy (parallel/diloco/strategy.py) and the closed forms (theory.py) read these two
definitions; neither is a measurement, so theory stays independent of the code it checks.

Fragments. The model's parts, in forward order, are the embedding, each block and the head (final
norm and output layer): L + 2 parts, as parallel/algebra.py's `part_parameter_counts` counts them.
F fragments are F contiguous runs of parts, as even in count as they can be, the longer ones first.

Schedule (Streaming DiLoCo, Douillard et al. 2025, §2): fragment f syncs after the inner steps t
(counted from 1) with (t − o_f) mod H = 0, where the offsets o_f = ⌊f·H/F⌋ spread the F syncs over
the H steps. Fragment 0 syncs at H, 2H, ...; with F = 1 that is plain DiLoCo. Any H consecutive steps
hold exactly one sync of every fragment, which is what makes the mean bytes per step exact.
"""

from __future__ import annotations


def fragment_parts(parts: int, fragments: int) -> list[range]:
    """The parts (their indices, forward order) of each fragment: F contiguous runs."""
    base, longer = divmod(parts, fragments)
    runs, start = [], 0
    for f in range(fragments):
        end = start + base + (1 if f < longer else 0)
        runs.append(range(start, end))
        start = end
    return runs


def offset(fragment: int, inner_steps: int, fragments: int) -> int:
    """o_f = ⌊f·H/F⌋: the step within each period of H at which fragment f syncs."""
    return fragment * inner_steps // fragments


def syncing(step: int, inner_steps: int, fragments: int) -> list[int]:
    """The fragments that sync after inner step `step` (counted from 1)."""
    return [f for f in range(fragments) if (step - offset(f, inner_steps, fragments)) % inner_steps == 0]
