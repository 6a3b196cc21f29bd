"""Taking a checkpoint during training, and what it cost each rank.

Two independent choices (`train.checkpoint_async`, `train.checkpoint_sharded`):

    gathered (default)  the strategy gathers the whole state to every rank (collective), rank 0
                        writes it with DCP (checkpoint.py); the other ranks write 0 bytes
    sharded             each rank snapshots only the pieces it holds (sharded.py) and writes
                        them; rank 0 publishes once every rank's part is on disk. ZeRO-1/2/3 and
                        FSDP2 hold pieces; a strategy without (`checkpoint_pieces()` is None) is
                        gathered to rank 0 and written in the sharded format by rank 0 alone
    sync (default)      training waits for the snapshot, the write and the publish
    async               training waits only for the snapshot, a copy in host memory that the
                        steps cannot change; a background thread writes and publishes it while
                        the next steps run, as torch.distributed.checkpoint's async_save does.
                        One save at most in flight: the next save, and the end of the run, wait
                        for the last one, and a writer's error is raised there, on its rank.

Every save is recorded per rank, in seconds of the host clock: `wait_s` (for the previous async
save), `snapshot_s` (the gather or copy: training is stopped), `write_s` (files written and
synced), `publish_s` (rank 0: every part on disk, the rename, `latest`), `blocked_s` (what the
training loop waited: wait + snapshot, and in sync mode write + publish too), and `bytes` (the
files this rank wrote) beside `tensor_bytes` (the state it wrote, exact).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from parallel.reliability.checkpoint import (
    CheckpointError,
    fresh_tmp_dir,
    publish,
    step_dir_name,
    write_checkpoint,
    write_meta,
)
from parallel.reliability.sharded import wait_for_parts, write_manifest, write_rank_part
from parallel.sync.pieces import Piece, RankState, model_key, moment_key

log = logging.getLogger("parallel")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _copied(state: dict) -> dict:
    """A nested dict of tensors with every tensor copied to fresh host memory."""
    return {k: _copied(v) if isinstance(v, dict) else v.detach().to("cpu", copy=True) if hasattr(v, "detach") else v
            for k, v in state.items()}


def gathered_pieces(model_state: dict, optim_state: dict) -> RankState:
    """The whole state as whole-tensor pieces: what rank 0 writes for a strategy without shards."""
    pieces = [Piece(model_key(n), tuple(t.shape), 0, t.reshape(-1)) for n, t in model_state.items()]
    for name, moments in optim_state["state"].items():
        pieces += [Piece(moment_key(name, m), tuple(t.shape), 0, t.reshape(-1)) for m, t in moments.items()]
    return RankState(pieces, int(optim_state["step"]))


class CheckpointSaver:
    """Saves the run's checkpoints in the configured mode and keeps each save's record."""

    def __init__(self, plan, ctx, strategy, root: Path):
        self.asynchronous, self.sharded = plan.checkpoint_async, plan.checkpoint_sharded
        self.ctx, self.strategy, self.root = ctx, strategy, root
        self.timeout_s = plan.timeout_s
        self.token = ctx.peers[0][1] if ctx.peers else os.getpid()  # rank 0's pid: one tmp name on every rank
        self.mode = f"{'sharded' if self.sharded else 'gathered'}, {'async' if self.asynchronous else 'sync'}"
        self.records: list[dict] = []
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        if plan.checkpoint_every and not self.sharded:
            # DCP's import takes about a second: paid at set-up, not inside the first save.
            import torch.distributed.checkpoint  # noqa: F401

    # -- the loop's two calls ------------------------------------------------------------------------
    def save(self, steps_done: int, meta: dict, before_rename=None) -> None:
        """Checkpoint the state after `steps_done` steps (every rank calls it, at the same step)."""
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        write = self._snapshot(steps_done, meta, before_rename)
        snapped = time.perf_counter()
        record = {"step": steps_done, "rank": self.ctx.rank, "mode": self.mode, "wait_s": waited - start,
                  "snapshot_s": snapped - waited, "write_s": 0.0, "publish_s": 0.0, "bytes": 0, "tensor_bytes": 0}
        self.records.append(record)
        if self.asynchronous:
            record["blocked_s"] = snapped - start
            self._writer = threading.Thread(target=self._write_in_background, args=(write, record),
                                            name=f"checkpoint-{steps_done}", daemon=True)
            self._writer.start()
        else:
            write(record)
            record["blocked_s"] = time.perf_counter() - start
            self._log(record)

    def wait(self) -> None:
        """Until the save in flight (if any) is written; its error, if it failed, is raised here."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"rank {self.ctx.rank}: the background checkpoint writer failed: {error}") from error

    # -- the two parts of a save ---------------------------------------------------------------------
    def _snapshot(self, steps_done: int, meta: dict, before_rename):
        """The state as it is now (collective in gathered mode), and the function that writes it."""
        if self.sharded:
            state = self.strategy.checkpoint_pieces()
            if state is None:  # this strategy holds no per-rank shards: gather to rank 0; the others' parts are empty
                model_state, optim_state = self.strategy.full_state_dict(), self.strategy.full_optimizer_state()
                state = gathered_pieces(model_state, optim_state) if self.ctx.is_rank0 else \
                    RankState([], int(optim_state["step"]))
            if self.asynchronous:
                state = state.host_copy()
            return lambda record: self._write_sharded(record, steps_done, state, meta, before_rename)
        model_state, optim_state = self.strategy.full_state_dict(), self.strategy.full_optimizer_state()
        if not self.ctx.is_rank0:
            return lambda record: record.update(published=None)  # rank 0 alone writes a gathered checkpoint
        if self.asynchronous:
            model_state, optim_state = _copied(model_state), _copied(optim_state)
        return lambda record: self._write_gathered(record, steps_done, model_state, optim_state, meta, before_rename)

    def _write_gathered(self, record, steps_done, model_state, optim_state, meta, before_rename) -> None:
        start = time.perf_counter()
        tmp = fresh_tmp_dir(self.root, steps_done, os.getpid())
        write_checkpoint(tmp, model_state, optim_state, meta)
        record["bytes"] = _dir_bytes(tmp)
        record["tensor_bytes"] = gathered_pieces(model_state, optim_state).nbytes()
        written = time.perf_counter()
        path = publish(self.root, tmp, steps_done, before_rename)
        self._finish(record, start, written, path)

    def _write_sharded(self, record, steps_done, state: RankState, meta, before_rename) -> None:
        start = time.perf_counter()
        tmp = self.root / f"{step_dir_name(steps_done)}.tmp-{self.token}"
        record["bytes"] = write_rank_part(tmp, self.ctx.rank, state)  # every rank: rank 0 waits for each part
        record["tensor_bytes"] = state.nbytes()
        written = time.perf_counter()
        path = None
        if self.ctx.is_rank0:
            wait_for_parts(tmp, self.ctx.env.world_size, self.timeout_s)
            record["bytes"] += write_manifest(tmp, self.ctx.env.world_size)
            write_meta(tmp, meta, state.optimizer_step)
            record["bytes"] += (tmp / "meta.json").stat().st_size
            path = publish(self.root, tmp, steps_done, before_rename)
        self._finish(record, start, written, path)

    def _finish(self, record: dict, start: float, written: float, path: Path | None) -> None:
        record["write_s"], record["publish_s"] = written - start, time.perf_counter() - written
        record["published"] = str(path) if path is not None else None  # rank 0's; None on the others

    def _log(self, record: dict) -> None:
        where = record.get("published") or f"{step_dir_name(record['step'])}, this rank's part"
        log.info("checkpoint %s (%s): %s", where, self.mode, describe(record))

    def _write_in_background(self, write, record: dict) -> None:
        try:
            write(record)
            self._log(record)
        except BaseException as e:  # kept for wait(), which raises it on the training thread
            log.error("error: checkpoint after step %d failed in the background writer: %s", record["step"], e)
            self._error = e


def describe(record: dict) -> str:
    """One save on one rank, in one line: what blocked training, what was written and how long it took."""
    blocked = record.get("blocked_s")
    return (f"{f'training blocked {blocked:.3f} s, ' if blocked is not None else ''}"
            f"wait {record['wait_s']:.3f} s, snapshot {record['snapshot_s']:.3f} s, write {record['write_s']:.3f} s, "
            f"publish {record['publish_s']:.3f} s, {record['bytes'] / 1e6:.2f} MB written by rank {record['rank']}")


def checkpoints_block(rank_reports: list[dict], first_step: int, warmup_steps: int) -> dict:
    """summary.json's `checkpoints`: every save, each rank's record (none: `saves` is empty); and each
    rank's time in the timed steps plus the saves that followed them (what the checkpoints cost the loop)."""
    by_step: dict[int, list[dict]] = {}
    for report in rank_reports:
        for record in report.get("checkpoints") or []:
            by_step.setdefault(record["step"], []).append(record)
    saves = [{"step": step, "mode": records[0]["mode"], "ranks": sorted(records, key=lambda r: r["rank"]),
              "bytes": sum(r["bytes"] for r in records), "max_blocked_s": max(r["blocked_s"] for r in records)}
             for step, records in sorted(by_step.items())]
    loop = [_loop_seconds(r, first_step, warmup_steps) for r in rank_reports]
    return {"mode": saves[0]["mode"] if saves else None, "saves": saves, "loop_s_by_rank": loop}


def _loop_seconds(report: dict, first_step: int, warmup_steps: int) -> float:
    """A rank's timed steps plus what its saves after them blocked it (the steps' time, saves included).
    A save after step k records k + 1 steps done."""
    saves = sum(r["blocked_s"] for r in report.get("checkpoints") or [] if r["step"] > first_step + warmup_steps)
    return sum(report["step_times"][warmup_steps:]) + saves
