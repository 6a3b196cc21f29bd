"""Where a rank's tokens sit in the sequence: the one function both position schemes read.

The learned table (parallel/core/model.py `Embedding`) and the rotary embedding
(parallel/core/rotary.py) each hold a `positions(length, device)` callable, this one by default;
context parallelism replaces it by its rank's chunks (parallel/cp/transform.py).
"""

from __future__ import annotations

import torch


def sequence_positions(length: int, device) -> torch.Tensor:
    """The positions of a whole sequence of `length` tokens: 0, 1, ..., length - 1."""
    return torch.arange(length, device=device)
