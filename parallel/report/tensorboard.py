"""TensorBoard event files next to metrics.jsonl (train.tensorboard=true), written by rank 0.

Every step (warm-up steps included, as in metrics.jsonl) gets, at global step = the training step:

    loss                      the global loss (metrics.jsonl's `loss`)
    tokens_per_s              metrics.jsonl's `tokens_per_s`
    step_time_s               metrics.jsonl's `step_time_s`
    time/<category>           rank 0's step breakdown (report/breakdown.py): compute, exposed_comm,
                              bubble, optimizer, other, in seconds; they add up to step_time_s
    bytes_sent/total          metrics.jsonl's `rank0_sent_bytes`: what rank 0 sent in the step
    bytes_sent/<group>        the same by process group (dp, tp, pp, ...)

The files go to train.tensorboard_dir, or <run dir>/tensorboard when it is null; `tensorboard
--logdir <run dir>` shows them. The sweep (launch.compare) gives each strategy its own directory
under <sweep dir>/tensorboard/, so `tensorboard --logdir <sweep dir>/tensorboard` overlays them.
TensorBoard is an optional dependency (`pip install -e '.[tensorboard]'`; launch/setup.sh installs it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from parallel.report.breakdown import five


def option_error(enabled, directory) -> str | None:
    """Why train.tensorboard / train.tensorboard_dir cannot be used as given (one line), or None."""
    if not isinstance(enabled, bool):
        return f"train.tensorboard={enabled!r} must be true or false"
    if directory is not None and not isinstance(directory, str):
        return f"train.tensorboard_dir={directory!r} must be a path, or null for <run dir>/tensorboard"
    if enabled and importlib.util.find_spec("tensorboard") is None:
        return ("train.tensorboard=true needs the tensorboard package, which is not installed: "
                "pip install -e '.[tensorboard]' (launch/setup.sh installs it), or train.tensorboard=false")
    return None


class TensorBoardWriter:
    """One SummaryWriter for the run; `write` takes what metrics.jsonl gets, plus the step's
    breakdown and traffic summary."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    @classmethod
    def open(cls, enabled: bool, directory: str | None, run_dir: Path) -> TensorBoardWriter | None:
        if not enabled:
            return None
        return cls(Path(directory) if directory else run_dir / "tensorboard")

    def write(self, record: dict, breakdown: dict | None, traffic: dict) -> None:
        step, add = record["step"], self._writer.add_scalar
        add("loss", record["loss"], step)
        add("tokens_per_s", record["tokens_per_s"], step)
        add("step_time_s", record["step_time_s"], step)
        if breakdown is not None:
            for category, seconds in five(breakdown).items():
                add(f"time/{category}", seconds, step)
        add("bytes_sent/total", record["rank0_sent_bytes"], step)
        for group, totals in sorted(traffic["by_group"].items()):
            add(f"bytes_sent/{group}", float(totals.sent_bytes), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
