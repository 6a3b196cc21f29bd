"""Byte-level text data with one global batch per step, whatever the topology.

Every rank builds the *global* batch of step k from (seed, k) alone, then keeps its data-parallel
slice and cuts that into microbatches. So dp=1 and dp=4, one microbatch or eight, all see the
same sequences in the same order, and their losses can be compared number for number.

The default corpus is the Python standard library's own source, which every Python install has:
a fresh machine trains on real text with no download.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


class DataError(ValueError):
    """The corpus cannot be used; the message says why and what to do."""


def stdlib_source_dir() -> Path:
    """The standard library's directory (never site-packages, whose contents differ per machine)."""
    return Path(sysconfig.get_paths()["stdlib"])


SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed packages differ between machines and caches are not text: prune them so
        # the default corpus is the same everywhere (and the walk stays fast).
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(TEXT_SUFFIXES))
    return files


def _looks_binary(chunk: bytes) -> bool:
    return b"\x00" in chunk


def load_corpus(path: str | None, max_bytes: int, min_bytes: int) -> torch.Tensor:
    """Read up to `max_bytes` of text from a file or a directory into a uint8 tensor.

    Files are read in sorted order, so the corpus is the same on every rank and every machine
    with the same files. Binary files (containing NUL bytes) are skipped in a directory and
    refused when named directly.
    """
    root = Path(path).expanduser() if path else stdlib_source_dir()
    if not root.exists():
        raise DataError(f"data.path={str(root)!r} does not exist: "
                        "point data.path at a text file or a directory of text files")
    files = _text_files(root)
    if not files:
        raise DataError(
            f"data.path={str(root)!r} holds no text files (looked for {', '.join(TEXT_SUFFIXES)}): "
            "point data.path at a directory with text, or at one text file"
        )
    chunks, total = [], 0
    for file in files:
        raw = file.read_bytes()[: max_bytes - total]
        if _looks_binary(raw):
            if root.is_file():
                raise DataError(f"data.path={str(root)!r} is a binary file (it contains NUL bytes): give a text file")
            continue
        chunks.append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if len(corpus) == 0:
        raise DataError(f"data.path={str(root)!r} is empty: give a file or directory with some text in it")
    if len(corpus) < min_bytes:
        raise DataError(
            f"data.path={str(root)!r} has {len(corpus)} bytes of text, fewer than one training sequence needs "
            f"({min_bytes} = model.seq_len + 1): use more text or a smaller model.seq_len"
        )
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).clone()


@dataclass
class Batch:
    inputs: torch.Tensor  # (sequences, seq_len) int64 token ids
    targets: torch.Tensor  # the same, shifted by one token

    @property
    def n_sequences(self) -> int:
        return self.inputs.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.inputs.numel()

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(self.inputs[start:stop], self.targets[start:stop])

    def split(self, parts: int) -> list[Batch]:
        """`parts` equal consecutive pieces (the caller has checked divisibility)."""
        size = self.n_sequences // parts
        return [self.rows(i * size, (i + 1) * size) for i in range(parts)]

    def to(self, device: torch.device) -> Batch:
        return Batch(self.inputs.to(device, non_blocking=True), self.targets.to(device, non_blocking=True))

    def checksum(self) -> int:
        """A cheap fingerprint of the token ids, logged so runs can prove they saw the same data."""
        weights = torch.arange(1, self.inputs.numel() + 1, dtype=torch.int64)
        return int((self.inputs.reshape(-1) * weights).sum())


class GlobalBatches:
    """Deterministic random windows of the corpus: step k -> the same global batch everywhere."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, global_batch: int, seed: int):
        if corpus.numel() < seq_len + 1:
            raise DataError(f"the corpus has {corpus.numel()} bytes, fewer than model.seq_len + 1 = {seq_len + 1}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed

    def __call__(self, step: int) -> Batch:
        # A generator seeded by (seed, step), not a stream advanced step by step: any step can be
        # regenerated on its own, which resuming from a checkpoint needs.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.corpus.numel() - self.seq_len, (self.global_batch,), generator=gen)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)
        windows = self.corpus[offsets].long()
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def local_microbatches(batch: Batch, dp_rank: int, dp: int, microbatches: int) -> list[Batch]:
    """This data-parallel rank's slice of the global batch, cut into microbatches."""
    per_rank = batch.n_sequences // dp
    return batch.rows(dp_rank * per_rank, (dp_rank + 1) * per_rank).split(microbatches)
