"""Crash-safe checkpoints that resume under any layout.

What is saved: the whole model and the whole of Adam's state, keyed by the *single-process*
parameter names (`model/blocks.0.attn.q.weight`, `optim/blocks.0.attn.q.weight/exp_avg`), written
with torch.distributed.checkpoint (DCP), plus a readable `meta.json`: the optimizer's step count,
the next training step, and the model and data settings. A checkpoint says nothing about the
layout that wrote it, so one saved under tp 2 loads under dp 2, pp 2 or a single process: each
strategy's `load_full_state` keeps its own part of the whole.

The data position is one number: the global batch of step k is a pure function of (seed, k)
(parallel/core/data.py), so saving the next step and the data settings is saving the data order.

Who writes: the strategy gathers the whole state to rank 0 (`full_state_dict`,
`full_optimizer_state`, both collective) and rank 0 alone writes it with DCP in one process
(`no_dist=True`). Every rank writing its own shard would be faster for big models, but its files
would follow the writing layout; one writer keeps the files layout-free at this sandbox's sizes.

Atomic: everything goes into `step_000006.tmp-<pid>/`, the files are fsynced (DCP's writer syncs
each file; meta.json and the directories are synced here), then one `os.rename` makes it
`step_000006/`, and `latest` is replaced through a temporary file and `os.replace`. A crash at
any moment leaves either the new checkpoint complete or the previous one untouched; readers
ignore `*.tmp*`.

    checkpoints/
      step_000003/  .metadata  __0_0.distcp  meta.json
      step_000006/  ...
      latest        "step_000006"
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from parallel.core.config import SHAPE_FIELDS
from parallel.core.model import MOE_FIELDS, GPTConfig

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"
MANIFEST = "manifest.json"  # a sharded save's (parallel/reliability/sharded.py)
LATEST = "latest"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the path and what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _flat_state(model_state: dict, optim_state: dict) -> dict[str, torch.Tensor]:
    flat = {f"model/{name}": t for name, t in model_state.items()}
    for name, moments in optim_state["state"].items():
        for key, t in moments.items():
            flat[f"optim/{name}/{key}"] = t
    return flat


def save_checkpoint(root: Path, step: int, model_state: dict, optim_state: dict, meta: dict,
                    before_rename=None) -> Path:
    """Write one checkpoint (rank 0 only); returns its directory.

    `before_rename` is called once every file is on disk but before the rename: the hook the
    fault injection uses to kill the process mid-save.
    """
    tmp = fresh_tmp_dir(root, step, os.getpid())
    write_checkpoint(tmp, model_state, optim_state, meta)
    return publish(root, tmp, step, before_rename)


def fresh_tmp_dir(root: Path, step: int, token: int) -> Path:
    """`step_NNNNNN.tmp-<token>/`, empty: where a checkpoint is written before it is published."""
    tmp = root / f"{step_dir_name(step)}.tmp-{token}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_checkpoint(tmp: Path, model_state: dict, optim_state: dict, meta: dict) -> None:
    """The whole state with DCP, in one process, and meta.json, synced, into `tmp`."""
    import torch.distributed.checkpoint as dcp  # imported only by runs that checkpoint (~1 s)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(_flat_state(model_state, optim_state), checkpoint_id=tmp, no_dist=True)
    write_meta(tmp, meta, int(optim_state["step"]))


def write_meta(tmp: Path, meta: dict, optimizer_step: int) -> None:
    _write_synced(tmp / META, json.dumps({"format": FORMAT_VERSION, **meta, "optimizer_step": optimizer_step},
                                         indent=2) + "\n")
    _fsync_dir(tmp)


def publish(root: Path, tmp: Path, step: int, before_rename=None) -> Path:
    """Make a fully written `tmp` the checkpoint of `step` (one rename), then point `latest` at it."""
    final = root / step_dir_name(step)
    if before_rename is not None:
        before_rename(tmp)
    if final.exists():
        # A resumed run re-saving a step an earlier run also reached: the new one replaces it.
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    _write_synced(latest_tmp, final.name + "\n")
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)
    return final


def _is_checkpoint(path: Path) -> bool:
    written = (path / ".metadata").is_file() or (path / MANIFEST).is_file()  # DCP's, or a sharded save's
    return path.is_dir() and (path / META).is_file() and written and ".tmp" not in path.name


def resolve_checkpoint(path: str) -> Path:
    """`path` is one checkpoint, or a checkpoints root meaning its latest complete checkpoint."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"train.resume={path!r} does not exist: give a checkpoint directory (step_NNNNNN) "
                              "or the checkpoints directory that holds them")
    if _is_checkpoint(p):
        return p
    if not p.is_dir():
        raise CheckpointError(f"train.resume={path!r} is a file, not a checkpoint directory: "
                              "give a step_NNNNNN directory or its parent")
    marker = p / LATEST
    if marker.is_file():
        named = p / marker.read_text().strip()
        if _is_checkpoint(named):
            return named
    # No marker (or it names a checkpoint that is gone): the highest complete step directory.
    steps = sorted((int(m.group(1)), d) for d in p.iterdir() if (m := STEP_DIR.match(d.name)) and _is_checkpoint(d))
    if not steps:
        raise CheckpointError(
            f"train.resume={path!r} holds no complete checkpoint (no step_NNNNNN directory with meta.json; "
            "unfinished *.tmp-* ones are ignored): point it at a run's checkpoints directory"
        )
    return steps[-1][1]


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META).read_text())


def load_checkpoint(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model state and optimizer state of a checkpoint, on the CPU, on every rank.

    Tensors are allocated from DCP's own metadata (names, shapes, dtypes), so loading needs no
    model to be built first; each rank reads the whole checkpoint and keeps its part later.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    flat = {key: torch.empty(m.size, dtype=m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat, checkpoint_id=checkpoint, no_dist=True)
    return split_flat_state(flat, read_meta(checkpoint)["optimizer_step"])


def split_flat_state(flat: dict[str, torch.Tensor], optimizer_step: int) -> tuple[dict, dict]:
    """`model/<name>` and `optim/<name>/<moment>` keys back into (model state, optimizer state)."""
    model_state, moments = {}, {}
    for key, t in flat.items():
        kind, rest = key.split("/", 1)
        if kind == "model":
            model_state[rest] = t
        else:
            name, moment = rest.rsplit("/", 1)
            moments.setdefault(name, {})[moment] = t
    return model_state, {"step": int(optimizer_step), "state": moments}


# What must be equal for a resumed run to be the continuation of the saved one.
MODEL_KEYS = ("vocab_size", "vocab_pad_multiple", "seq_len", "n_layers", "d_model", "n_heads", "mlp_ratio",
              *MOE_FIELDS, *SHAPE_FIELDS)
# A checkpoint written before the model had experts or Llama's block holds a dense GPT-2: the defaults.
_UNRECORDED = {k: getattr(GPTConfig(), k) for k in (*MOE_FIELDS, *SHAPE_FIELDS)}
DATA_KEYS = ("seed", "global_batch", "data_path", "data_max_bytes", "seq_len")


def checkpoint_meta(plan, next_step: int) -> dict:
    """What a checkpoint records besides the tensors: enough to continue the same run."""
    return {
        "next_step": next_step,
        "model": {k: getattr(plan.model, k) for k in MODEL_KEYS},
        "data": {"seed": plan.seed, "global_batch": plan.global_batch, "data_path": plan.data_path,
                 "data_max_bytes": plan.data_max_bytes, "seq_len": plan.model.seq_len},
        "saved_by": {"strategy": plan.strategy, **plan.dims.as_dict()},
    }


def check_resumable(meta: dict, plan_model: dict, plan_data: dict, steps: int, warmup_steps: int | None,
                    where: str) -> int:
    """The step to continue from, or a CheckpointError saying what differs and how to fix it."""
    saved = {**_UNRECORDED, **meta["model"]}
    changed = [f"model.{k}={plan_model[k]!r} (checkpoint: {saved[k]!r})"
               for k in MODEL_KEYS if saved[k] != plan_model[k]]
    if changed:
        raise CheckpointError(
            f"train.resume={where!r} holds a different model: {', '.join(changed)}: "
            "resume with the model settings it was saved with"
        )
    names = {"seed": "train.seed", "global_batch": "train.global_batch", "data_path": "data.path",
             "data_max_bytes": "data.max_bytes", "seq_len": "model.seq_len"}
    changed = [f"{names[k]}={plan_data[k]!r} (checkpoint: {meta['data'][k]!r})"
               for k in DATA_KEYS if meta["data"][k] != plan_data[k]]
    if changed:
        raise CheckpointError(
            f"train.resume={where!r} was trained on other data: {', '.join(changed)}: the batches would not "
            "continue the saved run's order; set them back, or start a fresh run without train.resume"
        )
    start = int(meta["next_step"])
    if warmup_steps is None:  # the default: min(3, half of the steps this run takes), at least one timed
        if start >= steps:
            raise CheckpointError(
                f"train.resume={where!r} continues at step {start}, but train.steps={steps}: there is no step left "
                f"to run: raise train.steps above {start}"
            )
        return start
    if start + warmup_steps >= steps:
        raise CheckpointError(
            f"train.resume={where!r} continues at step {start}, and train.steps={steps} with "
            f"train.warmup_steps={warmup_steps} leaves no timed step: raise train.steps above {start + warmup_steps}, "
            "or leave train.warmup_steps null (the default adapts to the steps left)"
        )
    return start
