"""Pipeline parallelism: schedules as data, the simulator that checks them, the runner that runs them.

  actions.py         the vocabulary: F, B, W and the sends and receives around them
  posting.py         how the executor posts the sends and receives, per backend, as data
  progress.py        whether a posting finishes under gloo's or NCCL's rules, else its first cycle
  placement.py       which rank holds which virtual stage (loop or V)
  schedules.py       GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV as lists of actions
  zero_bubble.py     the zero-bubble schedules: backward split into B and W, W moved into the bubbles
  split_backward.py  one chunk's backward in those two halves
  simulator.py       schedules run on given costs, and checked (deadlock-free, every action once)
  split.py           the one GPT cut into pipeline pieces
  executor.py        a schedule run for real over the pp communicator (and, posting as on NCCL, its links)
  timeline.py        what every rank did when: measured bubble beside the simulator's
  options.py         its options: the schedule, the chunks per rank, the layers of each, the posting
  rules.py           its refusals (schedule, split, a posting that would hang, the recipe's dp sync;
                     why it refuses MoE)
  search.py          the options the planner tries on a layout
  theory.py          its closed forms: the p2p bytes per step from the placement alone, the saved
                     activations walked along each rank's list (a schedule's bubble is in its record)

There is no strategy file here: the strategy `pp` is the recipe of parallel/compose/combined.py
with tp = cp = 1 (stages, the runner, a dp sync on top), so its entry is compose's
(parallel/compose/__init__.py). Derivations: docs/theory/pipeline.md.
"""

from __future__ import annotations

from parallel.family import Family
from parallel.pp.options import PPOptions
from parallel.pp.rules import pp_rules
from parallel.pp.search import pp_search, schedule_identity

# The entries of this family: none of its own (see above).
ENTRIES: tuple = ()


def _describe(layout, spec) -> dict:
    options, pipelined = layout.of(PPOptions), spec.uses(PPOptions)
    return {"schedule": options.schedule if pipelined else None,
            "virtual_stages": options.virtual_stages if pipelined else None,
            "pp_layers": list(options.layers) if pipelined and options.layers else None}


def _report(plan, rank_reports: list[dict], run_dir) -> dict:
    """The first pipeline's (dp 0, tp 0) ranks' spans of the last step, in stage order: the measured,
    simulated and closed-form bubble (parallel/pp/timeline.py)."""
    if not plan.spec.uses(PPOptions) or rank_reports[0]["pipeline_spans"] is None:
        return {}
    from parallel.pp.posting import posting_for
    from parallel.pp.timeline import pipeline_report

    options = plan.layout.of(PPOptions)
    spans = [r["pipeline_spans"] for r in sorted(rank_reports, key=lambda r: r["coords"]["pp"])
             if r["coords"]["dp"] == 0 and r["coords"]["tp"] == 0]
    block = pipeline_report(spans, options.schedule, plan.dims.pp, plan.microbatches, options.virtual_stages)
    block["executed_by_rank"] = [r["pipeline_executed"] for r in rank_reports]
    block["posting"] = posting_for(options.posting, plan.backend)  # how its sends and receives were posted
    return {"pipeline": block}


def _label(described: dict) -> list[str]:
    """The schedule's word, none on a one-stage row (a planner row names its pp beside: no pipeline runs)."""
    schedule, v = described["schedule"], described["virtual_stages"]
    if not schedule or described.get("pp") == 1:
        return []
    return [schedule + (f" v{v}" if v > 1 else "")]


def _identity(layout, spec) -> tuple:
    """Two schedule names that give the same action lists are one layout (interleaved with one chunk is 1F1B)."""
    options = layout.of(PPOptions)
    lists = None
    if spec.uses(PPOptions) and layout.dims.pp > 1:
        lists = schedule_identity(options.schedule, layout.dims.pp, layout.microbatches, options.virtual_stages)
    return lists, options.layers


FAMILY = Family("pp", PPOptions, rules=pp_rules, search=pp_search, describe=_describe, label=_label,
                identity=_identity, report=_report)
