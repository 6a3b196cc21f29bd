"""DiLoCo's refusals that need the model, checked by the run validator before any process group.

Each option's own range is its record's (options.py); what tp, pp, cp and ZeRO would need is the
registry's (the entry's `dims`: dp only) and the route table's (no dp sync to replace). Left here:
the fragments against the model's parts and against H.
"""

from __future__ import annotations

from parallel.algebra import part_parameter_counts
from parallel.diloco.options import DiLoCoOptions
from parallel.family import Check
from parallel.spec import ConfigError


def diloco_rules(check: Check) -> None:
    if not check.spec.uses(DiLoCoOptions):
        return
    options = check.layout.of(DiLoCoOptions)
    parts = len(part_parameter_counts(check.model))
    if options.fragments > parts:
        raise ConfigError(f"parallel.fragments={options.fragments} is more than the model's {parts} parts "
                          f"(the embedding, {check.model.n_layers} blocks, the head): use at most {parts}")
    if options.fragments > options.inner_steps:
        raise ConfigError(f"parallel.fragments={options.fragments} is more than parallel.inner_steps="
                          f"{options.inner_steps}: each fragment syncs once per H steps at its own offset, so at "
                          f"most H fragments fit: lower parallel.fragments or raise parallel.inner_steps")
