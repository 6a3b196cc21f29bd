"""Checkpoints: k steps + resume for k more equals 2k steps, on any layout, and a crash mid-save
leaves the previous checkpoint loadable; in every save mode (gathered or sharded, sync or async).

Each layout trains 6 steps saving after 3 (the state after 3 steps does not depend on how many
come after, so that checkpoint is what a 3-step run would leave), then a fresh run resumes from
it; its steps 3..5 must repeat the uninterrupted run's losses within 1e-6 relative. Checkpoints
hold single-process names only, so the tp 2 one is also resumed under pp 2, and a single-process
one under tp 2.
"""

import json
import math

import pytest
from launcher import TINY, TINY_LLAMA, assert_ok, max_rel_diff, run_train

from parallel.core.model import GPT, GPTConfig
from parallel.sync.shards import group_into_parts

SAVE = ["train.checkpoint_every=3"]
ASYNC = ["train.checkpoint_async=true"]
SHARDED = ["train.checkpoint_sharded=true"]


def _losses_by_step(run) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in run.metrics()}


def _check_continues(resumed, full, rtol: float) -> None:
    """The resumed run ran exactly steps 3..5, with the full run's losses and data."""
    summary = assert_ok(resumed)
    assert summary["first_step"] == 3
    got, want = _losses_by_step(resumed), _losses_by_step(full)
    assert sorted(got) == [3, 4, 5]
    diff = max_rel_diff([got[s] for s in (3, 4, 5)], [want[s] for s in (3, 4, 5)])
    assert diff <= rtol, f"resumed losses differ by {diff:.2e}: {got} vs {want}"
    assert [m["data_checksum"] for m in resumed.metrics()] == [m["data_checksum"] for m in full.metrics()[3:]]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    run = run_train(2, [*TINY, "parallel=tp", *SAVE], tmp_path_factory.mktemp("tp") / "run")
    assert_ok(run)
    return run


@pytest.mark.parametrize("nproc,preset,mode", [(2, "dp", ASYNC)], ids=["2-dp-async"])
def test_resume_on_the_same_layout_repeats_the_run(nproc, preset, mode, tmp_path):
    """dp saves asynchronously (a host snapshot written while steps 4-6 run): the state it wrote is
    the state after step 3, so resuming repeats steps 3..5 bit for bit, as a synchronous save does
    (tests/runs/test_restart.py resumes seven strategies' synchronous saves at world 4, bit for bit)."""
    full = run_train(nproc, [*TINY, f"parallel={preset}", *SAVE, *mode], tmp_path / "full")
    saves = assert_ok(full)["checkpoints"]["saves"]
    meta = json.loads((full.run_dir / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta["next_step"] == 3 and meta["optimizer_step"] == 3 and meta["data"]["seed"] == 1234
    assert (full.run_dir / "checkpoints" / "latest").read_text().strip() == "step_000006"
    # Each save's cost on each rank; a gathered save is written by rank 0 alone.
    assert [s["step"] for s in saves] == [3, 6] and all(len(s["ranks"]) == nproc for s in saves)
    assert all(s["ranks"][0]["bytes"] > 0 and s["ranks"][1]["bytes"] == 0 for s in saves)
    assert saves[0]["mode"] == ("gathered, async" if mode else "gathered, sync")
    resumed = run_train(nproc, [*TINY, f"parallel={preset}", f"train.resume={full.run_dir}/checkpoints/step_000003"],
                        tmp_path / "resumed")
    _check_continues(resumed, full, rtol=0.0 if mode else 1e-6)


def test_tp_checkpoint_resumes_under_tp_and_pp(tp_run, tmp_path):
    ckpt = f"train.resume={tp_run.run_dir}/checkpoints/step_000003"
    _check_continues(run_train(2, [*TINY, "parallel=tp", ckpt], tmp_path / "tp"), tp_run, rtol=1e-6)
    # Another layout sums in another order: the project's cross-layout tolerance (1e-5).
    _check_continues(run_train(2, [*TINY, "parallel=pp_gpipe", ckpt], tmp_path / "pp"), tp_run, rtol=1e-5)


@pytest.mark.parametrize("mode", [[], ASYNC], ids=["sync", "async"])
def test_kill_during_save_keeps_the_last_checkpoint(single_run, tmp_path, mode):
    """SIGKILL while step 4's checkpoint is on disk but not yet published: step 2's stays the
    latest, and resuming from the checkpoints directory continues from it exactly, in one process
    and (once) under tp 2. Asynchronous: the background writer is killed while steps 5-6 train."""
    killed = run_train(1, [*TINY, "parallel=single", "train.checkpoint_every=2", *mode,
                           "train.fail_mode=kill_during_save", "train.fail_at_step=4"], tmp_path / "killed")
    assert killed.returncode == -9, killed.stderr[-2000:]
    root = killed.run_dir / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names[:2] == ["latest", "step_000002"] and names[2].startswith("step_000004.tmp-") and len(names) == 3, names
    assert (root / "latest").read_text().strip() == "step_000002"
    # Steps 0..3 ran (an async save lets steps 4-5 run too, until the kill) and match the reference run.
    losses = [m["loss"] for m in killed.metrics()]
    assert len(losses) >= 4 and max_rel_diff(losses, single_run.summary["losses"][:len(losses)]) < 1e-6
    resumed = run_train(1, [*TINY, "parallel=single", f"train.resume={root}"], tmp_path / "resumed")
    summary = assert_ok(resumed)
    assert summary["first_step"] == 2
    assert max_rel_diff(summary["losses"], single_run.summary["losses"][2:]) < 1e-6
    if mode:
        return
    # The reverse layout change: a single-process checkpoint resumed under tp 2.
    on_tp = assert_ok(run_train(2, [*TINY, "parallel=tp", f"train.resume={root}"], tmp_path / "on_tp"))
    assert on_tp["first_step"] == 2
    assert max_rel_diff(on_tp["losses"], single_run.summary["losses"][2:]) < 1e-5


def _shard_bytes(preset: str, meta: dict, world: int, rank: int) -> int:
    """The closed form of what a rank of a sharded save writes: its shard of every parameter and of
    Adam's two moments, 3 x 4 bytes an element, no padding. ZeRO-3: elements [rS, (r+1)S) of each
    part's flat buffer padded to N·S; FSDP2: rows [r·ceil(d0/N), (r+1)·ceil(d0/N)) of each parameter."""
    named = list(GPT(GPTConfig(**meta["model"]), seed=0).named_parameters())
    if preset == "zero3":
        return 12 * sum(max(0, min(part.hi, part.numel) - part.lo) for part in group_into_parts(named, world, rank))
    rows = [(p.shape[0], -(-p.shape[0] // world), math.prod(p.shape[1:])) for _, p in named]
    return 12 * sum(min(max(d0 - rank * r, 0), r) * inner for d0, r, inner in rows)


@pytest.mark.parametrize("preset,settings,reference,resume_on,strategy", [
    ("zero3", TINY, "single_run", (4, ["parallel=pp_1f1b", "parallel.tp=2", "parallel.microbatches=2"]), "3d"),
    ("torch_fsdp2", TINY_LLAMA, "single_run_llama", (1, ["parallel=single"]), "single"),
], ids=["zero3-sync-tiny", "torch_fsdp2-async-tiny_llama"])
def test_sharded_checkpoint_is_written_by_every_rank_and_resumes_elsewhere(preset, settings, reference, resume_on,
                                                                           strategy, request, tmp_path):
    """A sharded save at world 4 (ZeRO-3 sync; FSDP2 async, on Llama's block): each rank writes its
    own shard, never the whole model, the closed form's bytes (about a quarter each); the checkpoint
    resumes under another layout (dp 1 x tp 2 x pp 2; one process) within 1e-5 of the reference."""
    single = request.getfixturevalue(reference)
    mode = [] if preset == "zero3" else ASYNC
    sharded = run_train(4, [*settings, f"parallel={preset}", *SAVE, *SHARDED, *mode], tmp_path / preset)
    summary = assert_ok(sharded)
    assert max_rel_diff(summary["losses"], single.summary["losses"]) < 1e-5
    step3 = sharded.run_dir / "checkpoints" / "step_000003"
    meta = json.loads((step3 / "meta.json").read_text())
    whole = 12 * sum(p.numel() for p in GPT(GPTConfig(**meta["model"]), seed=0).parameters())
    for save in summary["checkpoints"]["saves"]:
        written = [r["tensor_bytes"] for r in save["ranks"]]
        assert written == [_shard_bytes(preset, meta, 4, r) for r in range(4)] and sum(written) == whole
        assert 0.2 < written[0] / whole < 0.3, written
        assert save["mode"] == f"sharded, {'async' if mode else 'sync'}"
    assert sorted(p.name for p in step3.glob("rank_*.bin")) == [f"rank_{r:05d}.bin" for r in range(4)]
    nproc, layout = resume_on
    resumed = run_train(nproc, [*settings, *layout, f"train.resume={step3}"], tmp_path / "resumed")
    summary = assert_ok(resumed)
    assert summary["strategy"] == strategy and summary["first_step"] == 3
    assert max_rel_diff(summary["losses"], single.summary["losses"][3:]) < 1e-5


def test_every_strategy_checkpoints_and_resumes_under_another(tmp_path):
    """Every strategy of the registry, ours and PyTorch's, saves after 3 steps; the next one in
    the list loads that checkpoint from disk and trains steps 3..5: losses and final parameters
    equal an uninterrupted single-process run (tests/helpers/checkpoint_every_strategy.py, one job of 4
    processes, each layout on its own mesh). Then the same for a mixture of experts over every
    strategy that trains one, expert parallelism at ep 4 and at dp 4 x ep 2 included, for Llama's
    block over the strategies that cut it, and for its tied head over those that train one."""
    import os
    import subprocess
    import sys

    from launcher import CPU_ONLY, PROJECT_ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(PROJECT_ROOT / "tests" / "helpers" / "checkpoint_every_strategy.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    resumed = [line for line in proc.stdout.splitlines() if " resumed: losses within " in line]
    # 32 strategies on the dense model, 15 layouts on the mixture of experts (tiny_moe), 8 on Llama's
    # block (tiny_llama) and 9 with its head tied.
    assert len(resumed) == 32 + 15 + 8 + 9 and "every strategy checkpoints: ok" in proc.stdout, proc.stdout
    for kind, count in (("moe", 15), ("llama", 8), ("tied", 9)):
        assert sum(f"[{kind}] resumed" in line for line in resumed) == count, proc.stdout
