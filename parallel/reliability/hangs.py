"""A hang, named: every rank dumps its flight recorder, one rank says which rank the others wait for.

    a call times out on some rank (parallel.timeout_s)
      -> that rank dumps its ring to <run dir>/flight/rank_NNNNN.json and writes flight/dump_request
      -> every rank's watcher thread (parallel/dist/flight.py) sees the request and dumps its ring,
         the hung rank's included: its training thread is stuck, its watcher is not
      -> rank 0's watcher waits up to DUMP_WAIT_S for every dump, reads them (hang_verdict.py) and
         prints the verdict, and writes it to flight/verdict.txt and verdict.json
      -> the rank that timed out waits for the verdict before it exits (torchrun then stops the
         job): the job still ends within parallel.timeout_s and a few seconds

If rank 0 cannot (it died, or is stuck where no thread of it runs), a rank that timed out writes the
verdict instead, the lowest first: each waits a little longer than the rank below it, and the first
to claim flight/verdict.claim writes it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from parallel.dist.failures import TIMEOUT, failure_kind, failure_line
from parallel.dist.flight import DumpWatcher, dump_path, request_dumps
from parallel.reliability.hang_verdict import hang_verdict

DUMP_WAIT_S = 3.0  # how long the verdict waits for the dumps; a watcher answers within a tenth of a second
STAGGER_S = 0.25  # how much longer each rank above 0 waits before writing a verdict rank 0 has not


def watch_for_hangs(ctx, run_dir: Path) -> None:
    """Start this rank's watcher; rank 0 clears a previous attempt's dumps first. Nothing for one process.
    The directory is the run's: ranks on several machines need it on a shared filesystem to see each
    other's request and dumps (else each machine's ranks answer their own, and the verdict names the
    others as ranks without a dump)."""
    if ctx.backend is None:
        return
    directory = Path(run_dir) / "flight"  # made by the first dump: a run that never hangs has none
    if ctx.is_rank0 and directory.is_dir():
        for stale in directory.iterdir():
            stale.unlink(missing_ok=True)
    ctx.log.flight.directory = directory
    world = ctx.env.world_size
    after = (lambda: write_verdict(directory, world, 0)) if ctx.is_rank0 else None
    DumpWatcher(ctx.log.flight, directory, ctx.rank, after).start()


def report_hang(ctx, error: BaseException, wait_s: float = DUMP_WAIT_S) -> None:
    """On this rank's timeout: dump, ask every rank for its dump, and wait for (or write) the verdict:
    rank 0's watcher waits `wait_s` for the dumps, so this rank waits half as long again, and a
    little longer the higher its rank, before it writes the verdict itself."""
    directory = getattr(ctx.log.flight, "directory", None)
    if directory is None or failure_kind(failure_line(error)) != TIMEOUT:
        return
    ctx.log.flight.dump(directory, ctx.rank, "timeout")
    request_dumps(directory, ctx.rank)
    deadline = time.monotonic() + 1.5 * wait_s + STAGGER_S * ctx.rank
    while time.monotonic() < deadline:
        if (directory / "verdict.txt").exists():
            return
        time.sleep(0.05)
    write_verdict(directory, ctx.env.world_size, ctx.rank, wait_s)


def collect_dumps(directory: Path, world_size: int, wait_s: float = DUMP_WAIT_S) -> dict[int, dict]:
    """Every rank's dump, waiting up to `wait_s` for those not written yet."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(dump_path(directory, r).exists() for r in range(world_size)):
        time.sleep(0.05)
    dumps = {}
    for rank in range(world_size):
        try:
            dumps[rank] = json.loads(dump_path(directory, rank).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    return dumps


def write_verdict(directory: Path, world_size: int, rank: int, wait_s: float = DUMP_WAIT_S) -> str | None:
    """Read the dumps and say the verdict, unless another rank has claimed it: the line, or None."""
    try:
        os.close(os.open(directory / "verdict.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    verdict = hang_verdict(collect_dumps(directory, world_size, wait_s), world_size)
    (directory / "verdict.json").write_text(json.dumps({**verdict.as_dict(), "written_by": rank}, indent=1))
    line = f"hang verdict (rank {rank}, from the flight recorders in {directory}): {verdict.line}"
    # Said before the file appears: the rank that timed out exits once it sees the file.
    print(line, file=sys.stderr, flush=True)
    tmp = directory / "verdict.txt.tmp"
    tmp.write_text(line + "\n")
    tmp.replace(directory / "verdict.txt")
    return line
