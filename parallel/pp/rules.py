"""Pipeline parallelism's refusals, checked by the run validator before any process group.

For every entry the pipeline cuts (the schedule's name is its options record's own check): the layers' split into
pp x virtual pieces, the schedule's own rule on (pp, m, v) and the entry's (PyTorch's schedules
refuse some that ours run); for the entries this project's executor runs, that the lists finish
under the run's backend as the executor posts them (a schedule that would hang is refused here,
naming its first cycle, not met as a hang). And why a pipeline refuses a mixture of experts
(docs/experts.md).
"""

from __future__ import annotations

from collections.abc import Callable

from parallel.core.model import GPTConfig
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.family import Check
from parallel.pp.options import PPOptions
from parallel.pp.posting import posting_for
from parallel.pp.progress import RULES, PlanInvalid, schedule_deadlock
from parallel.pp.schedules import ScheduleError, check_schedule
from parallel.pp.split import SplitError, layer_counts
from parallel.spec import ConfigError

PP_NO_MOE = ("a pipeline stage that holds MoE blocks must back-propagate their balancing loss beside the gradient it "
             "receives, and the pipeline runner back-propagates the last stage's loss only")
PP_NO_TIED_HEAD = ("the embedding and the head sit on different stages, each of which would train its own copy of "
                   "the table (Megatron all-reduces the two copies' gradients; this runner does not)")


def pp_rules(check: Check) -> None:
    """For every entry the pipeline cuts: its layers, the schedule's rule and the entry's own."""
    if not check.spec.uses(PPOptions):
        return
    options = check.layout.of(PPOptions)
    check_pipeline(check.model, check.dims, options.schedule, check.layout.microbatches, options.virtual_stages,
                   options.layers, check.spec.schedule_check)
    if not check.spec.honours_option(PPOptions, "posting"):
        if options.posting != "auto":
            raise ConfigError(f"parallel.pp_posting={options.posting} chooses how this project's pipeline executor "
                              f"posts its sends and receives, but parallel={check.spec.name} runs PyTorch's own "
                              "schedules, which post theirs: set parallel.pp_posting=auto")
        return
    if check.dims.pp > 1 and check.replay_schedule:
        check_posting(options.schedule, check.dims.pp, check.layout.microbatches, options.virtual_stages,
                      options.posting, check.backend)


def posting_refusal(layout, backend: str | None) -> str | None:
    """check_posting's refusal of a layout whose posting was not replayed when it was planned, or None."""
    if layout.dims.pp < 2:
        return None
    options = layout.of(PPOptions)
    try:
        check_posting(options.schedule, layout.dims.pp, layout.microbatches, options.virtual_stages,
                      options.posting, backend)
    except ConfigError as e:
        return str(e)
    return None


def check_posting(schedule: str, stages: int, microbatches: int, virtual: int, choice: str,
                  backend: str | None) -> None:
    """The schedule, as the executor will post it, must finish under the backend's rules
    (progress.py); with no backend known, under both."""
    for rules in (backend,) if backend is not None else RULES:
        posting = posting_for(choice, rules)
        try:
            deadlock = schedule_deadlock(schedule, stages, microbatches, virtual, posting, rules)
        except PlanInvalid as e:
            deadlock = e
        if deadlock is not None:
            sizes = f"parallel.pp={stages}, parallel.microbatches={microbatches}" + (
                f", parallel.virtual_stages={virtual}" if virtual > 1 else "")
            raise ConfigError(f"parallel.schedule={schedule} at {sizes} cannot run on {rules} as the pipeline "
                              f"executor posts it ({posting} posting): {deadlock}; fix the schedule's lists "
                              "or choose another schedule")


def check_pipeline(model: GPTConfig, dims: ParallelDims, schedule: str, microbatches: int, virtual_stages: int,
                   pp_layers, schedule_check: Callable | None) -> None:
    """The layers must split into pp x virtual pieces and the schedule must accept (pp, m, v), and
    so must the strategy's own runner (`schedule_check`, the entry's: PyTorch's schedules refuse
    some that ours run)."""
    if virtual_stages > 1 and dims.pp < 2:
        raise LayoutError(
            f"parallel.virtual_stages={virtual_stages} interleaves chunks across pipeline ranks, "
            f"but parallel.pp={dims.pp}: "
            "use at least 2 pipeline ranks, or parallel.virtual_stages=1"
        )
    try:
        layer_counts(model.n_layers, dims.pp * virtual_stages, list(pp_layers) if pp_layers is not None else None)
        check_schedule(schedule, dims.pp, microbatches, virtual_stages)
        if schedule_check is not None:
            schedule_check(schedule, dims.pp, microbatches, virtual_stages)
    except (ScheduleError, SplitError) as e:
        raise ConfigError(str(e)) from None
