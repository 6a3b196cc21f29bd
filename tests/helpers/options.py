"""A family's option of a plan or layout by its config key (`option(plan, "zero")`), for tests that
check what the run validator parsed without naming each family's record class."""

from __future__ import annotations

from parallel.family import option_keys
from parallel.registry import WITH_OPTIONS


def option(plan_or_layout, key: str):
    layout = getattr(plan_or_layout, "layout", plan_or_layout)
    for family in WITH_OPTIONS:
        fields = option_keys(family.options)
        if key in fields:
            return getattr(layout.of(family.options), fields[key])
    raise KeyError(f"no family has the option parallel.{key}")
