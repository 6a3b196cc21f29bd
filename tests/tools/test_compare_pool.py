"""The sweep's pool of ranks (parallel/compare/pool.py, launch/forkserver.py): a run forked from
the pool is the run a fresh torchrun makes, and a run that fails or hangs ends its pool alone.

Runs of the tiny model at world 2, a few seconds each: three in one pool and two fresh beside them,
then a failed, a hung and a good run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import GIVEN_LOOPBACK, Run, run_train

from parallel.compare.pool import Pool, Pools

SMALL = ["model=tiny", "train.steps=3", "train.warmup_steps=1", "data.max_bytes=1000000", "train.peak_flops=1e11",
         "run.timeline=false", *GIVEN_LOOPBACK]
# The same model on long sequences and a large batch: its activations take a few hundred MB more.
LARGE = [*SMALL, "model.seq_len=256", "train.global_batch=64"]


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the pool's ranks inherit the sweep's environment


def pooled(pool: Pool, strategy: str, overrides: list[str], run_dir: Path, timeout_s: float = 200) -> tuple:
    return pool.run(["launch.train", strategy], [f"parallel={strategy}", *overrides, f"run.dir={run_dir}"], run_dir,
                    timeout_s)


def schema(value, path: str = "") -> set[str]:
    """Every key path of a summary (list items by their first element's keys; so are the items of a
    map keyed by rank, whose keys are data: which ranks the straggler score flagged depends on time)."""
    if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
        return schema(next(iter(value.values())), path + "{}")
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {f"{path}/{k}"} | schema(v, f"{path}/{k}")}
    if isinstance(value, list) and value:
        return schema(value[0], path + "[]")
    return set()


def test_a_pooled_run_is_the_fresh_run(tmp_path):
    """dp after a run that held far more memory, then PyTorch's DDP, in one pool; each as a fresh
    torchrun too. Same losses to the bit, same bytes, same summary schema, same files, and the
    peak memory of the fresh process: nothing of the run before it, and not less than a fresh
    process holds (a fork's page table starts without its parent's library pages)."""
    with Pool(2) as pool:
        assert pooled(pool, "dp", LARGE, tmp_path / "large")[:2] == ("ok", "")
        for strategy in ("dp", "torch_ddp"):
            status, error, _ = pooled(pool, strategy, SMALL, tmp_path / "pool" / strategy)
            assert (status, error) == ("ok", ""), (strategy, error)
        assert pool.alive
    large = Run(0, "", "", tmp_path / "large").summary
    for strategy in ("dp", "torch_ddp"):
        run_dir = tmp_path / "pool" / strategy
        mine = Run(0, "", "", run_dir).summary
        fresh = run_train(2, [f"parallel={strategy}", *SMALL], tmp_path / "fresh" / strategy).summary
        assert mine["losses"] == fresh["losses"], strategy
        assert mine["comm"]["sent_bytes_per_step_exact"] == fresh["comm"]["sent_bytes_per_step_exact"]
        assert mine["memory"]["by_rank"] == [{**row, "peak_allocator_bytes": mine_row["peak_allocator_bytes"]}
                                             for row, mine_row in zip(fresh["memory"]["by_rank"],
                                                                      mine["memory"]["by_rank"])]
        assert schema(mine) == schema(fresh), schema(mine) ^ schema(fresh)
        for pooled_peak, fresh_peak in zip(mine["memory_by_rank"], fresh["memory_by_rank"]):
            assert abs(pooled_peak - fresh_peak) <= 0.03 * fresh_peak, (strategy, mine["memory_by_rank"],
                                                                       fresh["memory_by_rank"])
        # The run before held much more: none of it is in this run's figure.
        assert min(large["memory_by_rank"]) > max(mine["memory_by_rank"]) + 100e6
        for name in ("console.log", "metrics.jsonl", "trace.json", "logs/rank0.log", "logs/rank1.log"):
            assert (run_dir / name).stat().st_size > 0, name
        assert "done: 3 steps" in (run_dir / "console.log").read_text()


def our_processes(pool: Pool) -> list[int]:
    """Every process whose command line names the pool's directory: torchrun, its ranks and their forks."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(pool.dir).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_a_failed_or_hung_run_ends_its_pool_and_the_next_run_starts_another(tmp_path):
    with Pools() as pools:
        status, error, _ = pools.run(2, ["x"], ["parallel=dp", *SMALL, "train.fail_mode=raise", "train.fail_at_step=1",
                                                "train.fail_rank=1", f"run.dir={tmp_path / 'raise'}"],
                                     tmp_path / "raise", 200)
        assert status == "failed" and error.startswith("exit 1: ") and "rank 1" in error, error
        assert "injected failure" in (tmp_path / "raise" / "console.log").read_text()
        status, error, _ = pools.run(2, ["x"], ["parallel=dp", *SMALL, f"run.dir={tmp_path / 'after'}"],
                                     tmp_path / "after", 200)
        assert (status, error) == ("ok", "")
    with Pool(2) as pool:
        # Rank 0 sleeps at step 1; its peer waits in a collective for parallel.timeout_s (60 s): the
        # run's timeout comes first, and the pool is stopped with everything it started.
        status, error, seconds = pooled(pool, "dp", [*SMALL, "train.fail_mode=hang", "train.fail_at_step=1"],
                                        tmp_path / "hang", timeout_s=20)
        assert (status, error) == ("timeout", "stopped after 20 s (compare.timeout_s)")
        assert 20 <= seconds < 45 and not pool.alive
        assert our_processes(pool) == []
