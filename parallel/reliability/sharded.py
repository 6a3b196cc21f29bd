"""Sharded checkpoints: each rank writes only the state it holds, and any layout reads them back.

A sharded strategy holds, of each tensor of the single-process model, one contiguous run of its
elements in flattened (row-major) order: ZeRO's flat shards cut parameters wherever a shard
boundary falls, FSDP2's dim-0 chunks are a run of whole rows. So a rank's part of the state is a
list of pieces (parallel/sync/pieces.py: single-process key, whole shape, offset in the flattened
tensor, 1-D values), and nothing has to be gathered to save it:

    step_000006/
      rank_00000.bin   rank 0's pieces, their raw bytes end to end (exactly the tensor bytes)
      rank_00000.json  where each piece lies: key, shape, dtype, offset, numel, first byte
      rank_00001.bin   ...
      manifest.json    the world that wrote it, its ranks, tied names (written last, by rank 0)
      meta.json

Commit protocol, with no collective: each rank writes its .bin, syncs it, then writes its .json
under a temporary name and renames it, so a rank's index exists only once its bytes are on disk.
Rank 0 waits until every rank's index is there (or `timeout_s` passes: a peer died), writes the
manifest and meta.json, and publishes the directory with the same rename as a gathered save
(checkpoint.publish). The ranks must share the checkpoint directory's file system.

Loading reads every index, fills each whole tensor from its pieces (checking that they cover
every element exactly once) and returns the same whole state a gathered checkpoint gives: each
strategy's `load_full_state` then keeps its own part, whatever layout wrote the pieces.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from parallel.reliability.checkpoint import (
    MANIFEST,
    CheckpointError,
    _fsync_dir,
    _write_synced,
    load_checkpoint,
    split_flat_state,
)
from parallel.sync.pieces import RankState, model_key


# -- writing ----------------------------------------------------------------------------------------
def _rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def write_rank_part(tmp: Path, rank: int, state: RankState) -> int:
    """This rank's .bin and then its .json (the sign that the .bin is complete); returns bytes written."""
    tmp.mkdir(parents=True, exist_ok=True)
    index, start = [], 0
    with open(tmp / f"{_rank_name(rank)}.bin", "wb") as f:
        for piece in state.pieces:
            values = piece.values.detach().cpu().contiguous()
            f.write(values.view(torch.uint8).numpy().data)
            nbytes = values.numel() * values.element_size()
            dtype = str(values.dtype).removeprefix("torch.")
            index.append({"key": piece.key, "shape": list(piece.shape), "dtype": dtype, "offset": piece.offset,
                          "numel": values.numel(), "byte": start})
            start += nbytes
        f.flush()
        os.fsync(f.fileno())
    text = json.dumps({"rank": rank, "optimizer_step": state.optimizer_step, "aliases": state.aliases,
                       "pieces": index}) + "\n"
    partial = tmp / f"{_rank_name(rank)}.json.partial"
    _write_synced(partial, text)
    os.replace(partial, tmp / f"{_rank_name(rank)}.json")
    return start + len(text.encode())


def wait_for_parts(tmp: Path, world: int, timeout_s: float) -> None:
    """Rank 0, before publishing: every rank's index is on disk, or a CheckpointError naming who is missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world) if not (tmp / f"{_rank_name(r)}.json").is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"sharded checkpoint {tmp}: rank(s) {missing} did not write their part within "
                                  f"{timeout_s:.0f} s (parallel.timeout_s): it stays unpublished")
        time.sleep(0.01)


def write_manifest(tmp: Path, world: int) -> int:
    """The manifest that says the parts are complete (rank 0, after wait_for_parts); returns its bytes."""
    aliases = json.loads((tmp / f"{_rank_name(0)}.json").read_text())["aliases"]
    text = json.dumps({"format": "sharded", "world": world, "ranks": [_rank_name(r) for r in range(world)],
                       "aliases": aliases}, indent=2) + "\n"
    _write_synced(tmp / MANIFEST, text)
    _fsync_dir(tmp)
    return len(text.encode())


# -- reading ----------------------------------------------------------------------------------------
def load_state(checkpoint: Path) -> tuple[dict, dict]:
    """The whole state of a checkpoint in either format: sharded (a manifest), or gathered (DCP's)."""
    return load_sharded(checkpoint) if (checkpoint / MANIFEST).is_file() else load_checkpoint(checkpoint)


def load_sharded(checkpoint: Path) -> tuple[dict, dict]:
    """The whole model and optimizer state of a sharded checkpoint, on the CPU (as load_checkpoint)."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    flat: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    step = None
    for name in manifest["ranks"]:
        index = json.loads((checkpoint / f"{name}.json").read_text())
        step = index["optimizer_step"]
        raw = bytearray((checkpoint / f"{name}.bin").read_bytes())
        for entry in index["pieces"]:
            dtype = getattr(torch, entry["dtype"])
            whole = flat.setdefault(entry["key"], torch.empty(math.prod(entry["shape"]), dtype=dtype))
            nbytes = entry["numel"] * whole.element_size()
            values = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=entry["byte"]).view(dtype)
            whole[entry["offset"]: entry["offset"] + entry["numel"]].copy_(values)
            covered[entry["key"]] = covered.get(entry["key"], 0) + entry["numel"]
            shapes[entry["key"]] = entry["shape"]
    short = [k for k, t in flat.items() if covered[k] != t.numel()]
    if short:
        raise CheckpointError(f"{checkpoint}: the ranks' pieces do not cover {short[:3]} exactly once "
                              f"({len(short)} tensor(s)): the checkpoint is damaged")
    flat = {k: t.view(shapes[k]) for k, t in flat.items()}
    for alias, name in manifest["aliases"].items():
        flat[model_key(alias)] = flat[model_key(name)]
    return split_flat_state(flat, step)
