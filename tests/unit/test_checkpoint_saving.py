"""In-process checks of how checkpoints are taken (parallel/reliability/saving.py, sharded.py):
the pieces a sharded rank writes cover every tensor exactly once and read back whole, each rank's
bytes are its shard's closed form, an asynchronous save writes a copy and its writer's error
reaches the training thread, and the summary's `checkpoints` block. Fast: no process groups."""

import json
from types import SimpleNamespace

import pytest
import test_reliability
import torch
from test_layout import plan_for
from test_reliability import TINY

from parallel.reliability.checkpoint import (
    CheckpointError,
    checkpoint_meta,
    resolve_checkpoint,
    write_meta,
)
from parallel.reliability.saving import CheckpointSaver, _copied, checkpoints_block
from parallel.reliability.sharded import load_state, wait_for_parts, write_manifest, write_rank_part
from parallel.sync.pieces import RankState, flat_shard_pieces, model_key, moment_key, row_chunk_piece
from parallel.sync.shards import group_into_parts

MOMENTS = ("exp_avg", "exp_avg_sq")
trained = test_reliability.trained  # the fixture: a tiny single-process model after two steps (moments exist)


def _zero_rank_state(strategy, world: int, rank: int) -> RankState:
    """What ZeRO rank `rank` of `world` would write: its range of every part's flat parameters and
    moments, built from the whole state (zero_pieces' rule, on tensors a test can hold)."""
    moments = strategy.full_optimizer_state()["state"]
    pieces = []
    for part in group_into_parts(list(strategy.model.named_parameters()), world, rank):
        flat = part.flatten([p.detach() for p in part.params])
        pieces += flat_shard_pieces(part, flat[part.lo: part.hi], model_key)
        for m in MOMENTS:
            flat = part.flatten([moments[n][m] for n in part.names])
            pieces += flat_shard_pieces(part, flat[part.lo: part.hi], lambda n, m=m: moment_key(n, m))
    return RankState(pieces, strategy.optimizer.step_count)


def _publishable(tmp, states: list[RankState]) -> list[int]:
    """Every rank's part written into `tmp`, then the manifest and meta.json; each rank's bytes."""
    written = [write_rank_part(tmp, r, s) for r, s in enumerate(states)]
    wait_for_parts(tmp, len(states), timeout_s=1)
    write_manifest(tmp, len(states))
    write_meta(tmp, checkpoint_meta(plan_for(1, *TINY), 2), states[0].optimizer_step)
    return written


def _assert_same_state(got, strategy) -> None:
    model_state, optim_state = got
    want = strategy.full_optimizer_state()
    assert optim_state["step"] == want["step"]
    for n, p in strategy.model.named_parameters():
        assert torch.equal(model_state[n], p.detach()), n
        assert all(torch.equal(optim_state["state"][n][m], want["state"][n][m]) for m in MOMENTS), n


@pytest.mark.parametrize("world", [3, 4])
def test_zero_shards_read_back_whole_and_each_rank_writes_its_closed_form(trained, tmp_path, world):
    """A part of P elements padded to N·S: rank r writes params and both moments of elements
    [rS, (r+1)S) ∩ [0, P) of every part, 3 · 4 bytes each, and nothing of the padding."""
    states = [_zero_rank_state(trained, world, r) for r in range(world)]
    tmp = tmp_path / "step_000002"
    written = _publishable(tmp, states)
    for r, state in enumerate(states):
        parts = group_into_parts(list(trained.model.named_parameters()), world, r)
        closed_form = 3 * 4 * sum(max(0, min(p.hi, p.numel) - p.lo) for p in parts)
        assert state.nbytes() == closed_form == (tmp / f"rank_{r:05d}.bin").stat().st_size
        assert written[r] == closed_form + (tmp / f"rank_{r:05d}.json").stat().st_size
    total = sum(p.numel() for p in trained.model.parameters())
    assert sum(s.nbytes() for s in states) == 3 * 4 * total
    assert resolve_checkpoint(str(tmp)) == tmp  # manifest + meta: a complete checkpoint
    _assert_same_state(load_state(tmp), trained)


def test_row_chunks_as_torch_chunk_cuts_them(tmp_path):
    """FSDP2's dim-0 chunks (ceil(d0/N) rows each; a rank past the end holds none) read back whole."""
    world = 4
    whole = {"a": torch.arange(15.0).reshape(5, 3), "b": torch.arange(2.0), "c": torch.arange(14.0).reshape(2, 7)}
    states = []
    for r in range(world):
        pieces = []
        for n, t in whole.items():
            chunks = t.chunk(world)
            local = chunks[r] if r < len(chunks) else t[:0]
            pieces += row_chunk_piece(model_key(n), tuple(t.shape), local, r, world)
        states.append(RankState(pieces, 0))
    assert [len(s.pieces) for s in states] == [3, 3, 1, 0]  # "a" in 2+2+1 rows, "b" and "c" in 1+1
    _publishable(tmp_path, states)
    model_state, _ = load_state(tmp_path)
    assert all(torch.equal(model_state[n], t) for n, t in whole.items())


def test_a_missing_piece_is_damage_and_a_missing_rank_is_named(trained, tmp_path):
    states = [_zero_rank_state(trained, 2, r) for r in range(2)]
    states[1].pieces.pop()
    _publishable(tmp_path / "short", states)
    with pytest.raises(CheckpointError, match="do not cover"):
        load_state(tmp_path / "short")
    write_rank_part(tmp_path / "half", 0, states[0])
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] did not write their part"):
        wait_for_parts(tmp_path / "half", 2, timeout_s=0.05)


def test_an_async_snapshot_is_a_copy(trained):
    state = _zero_rank_state(trained, 2, 0)
    copy = state.host_copy()
    for a, b in zip(state.pieces, copy.pieces):
        assert torch.equal(a.values, b.values) and a.values.data_ptr() != b.values.data_ptr()
    nested = {"step": 2, "state": {"w": {"exp_avg": torch.ones(3)}}}
    copied = _copied(nested)
    original, copy = nested["state"]["w"]["exp_avg"], copied["state"]["w"]["exp_avg"]
    assert copied["step"] == 2 and torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()


def _saver(strategy, root, asynchronous: bool, sharded: bool, rank: int = 0, world: int = 1) -> CheckpointSaver:
    plan = SimpleNamespace(checkpoint_every=2, checkpoint_async=asynchronous, checkpoint_sharded=sharded,
                           timeout_s=5)
    peers = [("host", 1000 + r, "machine") for r in range(world)]  # rank 0's pid names the shared tmp directory
    ctx = SimpleNamespace(rank=rank, is_rank0=rank == 0, peers=peers, env=SimpleNamespace(world_size=world))
    return CheckpointSaver(plan, ctx, strategy, root)


def test_a_sharded_save_of_replicas_is_rank_0s_and_the_others_parts_are_empty(trained, tmp_path):
    """A strategy without shards of its own (here one process standing for both replicas of dp 2):
    rank 1 writes an empty part, so that rank 0, which writes everything, can publish."""
    other, first = (_saver(trained, tmp_path, False, True, rank, world=2) for rank in (1, 0))
    other.save(2, checkpoint_meta(plan_for(1, *TINY), 2))
    assert not (tmp_path / "step_000002").exists()  # unpublished until rank 0's part is there too
    first.save(2, checkpoint_meta(plan_for(1, *TINY), 2))
    assert other.records[0]["tensor_bytes"] == 0 and first.records[0]["tensor_bytes"] > 0
    _assert_same_state(load_state(resolve_checkpoint(str(tmp_path))), trained)


@pytest.mark.parametrize("asynchronous,sharded", [(False, False), (True, False), (True, True)])
def test_a_save_is_recorded_and_loads_back(trained, tmp_path, asynchronous, sharded):
    saver = _saver(trained, tmp_path, asynchronous, sharded)
    saver.save(2, checkpoint_meta(plan_for(1, *TINY), 2))
    saver.wait()
    _assert_same_state(load_state(resolve_checkpoint(str(tmp_path))), trained)
    [record] = saver.records
    assert record["step"] == 2 and record["tensor_bytes"] == 3 * 4 * sum(p.numel() for p in trained.model.parameters())
    on_disk = sum(f.stat().st_size for f in (tmp_path / "step_000002").iterdir())
    assert record["bytes"] == on_disk
    split = record["wait_s"] + record["snapshot_s"] + (0 if asynchronous else record["write_s"] + record["publish_s"])
    assert record["blocked_s"] >= split - 1e-6


def test_a_background_writers_error_reaches_the_training_thread(trained, tmp_path):
    root = tmp_path / "a_file"
    root.write_text("not a directory")
    saver = _saver(trained, root, asynchronous=True, sharded=False)
    saver.save(2, checkpoint_meta(plan_for(1, *TINY), 2))  # returns: the write runs behind
    with pytest.raises(CheckpointError, match="rank 0: the background checkpoint writer failed"):
        saver.wait()
    saver.wait()  # raised once; nothing in flight any more


def test_checkpoints_block_groups_each_save_by_rank():
    def record(step, rank, blocked):
        return {"step": step, "rank": rank, "mode": "sharded, sync", "wait_s": 0.0, "snapshot_s": 0.0,
                "write_s": 0.0, "publish_s": 0.0, "bytes": 10 * (rank + 1), "tensor_bytes": 0, "blocked_s": blocked}
    reports = [{"step_times": [5.0, 1.0, 1.0, 1.0], "checkpoints": [record(2, r, 0.5), record(4, r, 0.25)]}
               for r in range(2)]
    block = checkpoints_block(reports, first_step=0, warmup_steps=1)
    assert [s["step"] for s in block["saves"]] == [2, 4] and block["mode"] == "sharded, sync"
    assert [r["rank"] for r in block["saves"][0]["ranks"]] == [0, 1] and block["saves"][0]["bytes"] == 30
    # Timed steps 1..3 plus the saves after step 1 and step 3 (after 2 and 4 steps done).
    assert block["loop_s_by_rank"] == [3.75, 3.75]
    assert json.loads(json.dumps(block)) == block
    assert checkpoints_block([{"step_times": [1.0, 2.0], "checkpoints": []}], 0, 1) == {
        "mode": None, "saves": [], "loop_s_by_rank": [2.0]}
