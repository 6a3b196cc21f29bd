"""Which part of its step a rank is in: phases that tile the step, marked by the strategy.

A strategy's `train_step` calls `self.phases(name, label)` where one part of the step ends and the
next begins. Each mark is one StepClock stamp (parallel/dist/timing.py: a host clock read on the
CPU, a CUDA event on a GPU), the clock that times the step, so the marks tile exactly the step's
measured time: a phase lasts from its mark to the next one, the last to the step's end. What each
name counts as in the step's breakdown (report/breakdown.py):

    forward, backward, recompute   compute: the model's own arithmetic
    compute                        compute a strategy cannot split further (torch's pipeline schedule)
    optimizer                      the optimizer's step
    sync, p2p, other               the rest: gradient-sync bookkeeping, posting pipeline sends and
                                   receives, zeroing gradients, the finite check
    unmarked                       before the strategy's first mark: the training loop's own work
                                   (all of a step whose strategy marks nothing)

The communication a phase waited for is not taken out here: the breakdown subtracts the
communication log's spans from the phase they fall in. Recomputation inside backward is its own
phase where the code that recomputes marks it (`phases("recompute")`, then the phase it
interrupted); otherwise it is counted as backward, where it runs.

Each mark also reads the second clock, the thread's CPU time (dist/timing.py): a phase's CPU
seconds are what the replay (parallel/replay/) times it by, a device of its own per rank.

Outside the training loop (a strategy built by a test or a bench) there is no clock and a mark
costs one attribute test.
"""

from __future__ import annotations

CATEGORY_OF_PHASE = {
    "forward": "compute", "backward": "compute", "weight": "compute", "recompute": "compute", "compute": "compute",
    "optimizer": "optimizer", "sync": "other", "p2p": "other", "other": "other", "unmarked": "other",
}


class PhaseLog:
    """One rank's phase marks for the current step; `resolve()` turns them into spans."""

    def __init__(self):
        self.clock = None  # set for the duration of a step by the training loop
        self._marks: list[tuple[str, str, object, tuple]] = []  # phase, label, stamp, CPU stamp (timing.cpu_stamp)
        self._resolver = None

    def begin_step(self, clock) -> None:
        """The step began at the clock's origin: until the strategy's first mark it is "unmarked"."""
        self.clock = clock
        self._marks = [("unmarked", "", clock.origin, (clock.origin_cpu, clock.origin_helpers))]

    def __call__(self, phase: str, label: str = "") -> None:
        if self.clock is None:
            return
        if phase not in CATEGORY_OF_PHASE:
            raise ValueError(f"phase {phase!r} is none of {', '.join(CATEGORY_OF_PHASE)}")
        self._marks.append((phase, label, self.clock.now(), self.clock.cpu_now()))

    def stop(self) -> None:
        """The step is over (it ends at the clock's end): later marks are ignored."""
        self._resolver, self.clock = self.clock, None

    def resolve(self) -> list[dict]:
        """[{phase, label, start, end, cpu_start, cpu_end, helper_start, helper_end}] in seconds from
        the step's origin (wall, the thread's CPU time, and the CPU time of the process's other
        threads, gloo's), in order, the last one ending at the step's end; phases of zero wall
        length (two marks in a row) are left out."""
        if self._resolver is None:
            return []
        clock = self._resolver
        times = [clock.seconds(stamp) for _, _, stamp, _ in self._marks] + [clock.seconds(clock.end)]
        stamps = [c for _, _, _, c in self._marks] + [(clock.end_cpu, clock.end_helpers)]
        cpus = [clock.cpu_seconds(c) for c in stamps]
        helpers = [clock.helper_seconds(c) for c in stamps]
        return [{"phase": phase, "label": label, "start": times[i], "end": times[i + 1],
                 "cpu_start": cpus[i], "cpu_end": cpus[i + 1], "helper_start": helpers[i], "helper_end": helpers[i + 1]}
                for i, (phase, label, _, _) in enumerate(self._marks) if times[i + 1] > times[i]]
