"""Cut the one GPT into pipeline pieces.

The model is cut into p·v consecutive pieces ("virtual stages"): the embedding goes with the
first, the final norm, head and loss with the last, and the transformer blocks are divided among
them (evenly by default, or by an explicit list of layer counts). Which pieces rank r keeps is
the schedule's placement (placement.py): the loop, pieces r, r+p, r+2p, ... (Megatron's
interleaved layout; with v = 1 simply piece r), or the V, pieces r and 2p-1-r.

Each piece is cut from the full model built from the seed, so the pipeline starts from exactly
the single-process weights, and it remembers its blocks' global indices so that its parameters
can be named as in the single-process model again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.core.model import GPT
from parallel.pp.placement import Placement


class SplitError(ValueError):
    """A layer split that cannot work; the message names the value and a fix."""


def layer_counts(n_layers: int, pieces: int, explicit: list[int] | None = None) -> list[int]:
    """How many blocks each virtual stage holds."""
    if explicit is not None:
        explicit = list(explicit)
        if (len(explicit) != pieces or any(not isinstance(n, int) or n < 1 for n in explicit)
                or sum(explicit) != n_layers):
            raise SplitError(
                f"parallel.pp_layers={explicit} must list {pieces} positive layer counts (one per virtual stage: "
                f"pp x virtual_stages) summing to model.n_layers={n_layers}"
            )
        return explicit
    if n_layers % pieces:
        raise SplitError(
            f"model.n_layers={n_layers} does not split evenly into "
            f"parallel.pp x parallel.virtual_stages = {pieces} pieces: "
            f"use a layer count that is a multiple of {pieces}, or give parallel.pp_layers explicitly"
        )
    return [n_layers // pieces] * pieces


class PipelineChunk(nn.Module):
    """One virtual stage: [embedding] + some blocks + [final norm and head]."""

    def __init__(self, model: GPT, vstage: int, first_block: int, n_blocks: int, is_last: bool):
        super().__init__()
        self.vstage = vstage
        self.first_block = first_block
        self.embed = model.embed if vstage == 0 else None
        self.blocks = nn.ModuleList(model.blocks[first_block: first_block + n_blocks])
        self.head = model.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states or logits (last stage)."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def global_name(self, local_name: str) -> str:
        """`blocks.1.attn.q.weight` here -> `blocks.<first_block + 1>.attn.q.weight` in the full GPT."""
        if local_name.startswith("blocks."):
            _, index, rest = local_name.split(".", 2)
            return f"blocks.{self.first_block + int(index)}.{rest}"
        return local_name


def split_model(model: GPT, stages: int, virtual: int, rank: int, explicit: list[int] | None = None,
                placement: Placement | None = None) -> list[PipelineChunk]:
    """The chunks rank `rank` holds, chunk c being virtual stage `placement.vstage(rank, c)`
    (by default the loop: c·stages + rank)."""
    placement = placement or Placement(stages, virtual)
    counts = layer_counts(model.config.n_layers, stages * virtual, explicit)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    last = stages * virtual - 1
    return [PipelineChunk(model, vs, starts[vs], counts[vs], is_last=vs == last) for vs in placement.vstages_of(rank)]
