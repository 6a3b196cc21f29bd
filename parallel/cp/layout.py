"""Which tokens each context-parallel rank holds: the causal load-balanced ("head-tail") layout.

Under a causal mask, token i attends to tokens 0..i, so the late tokens cost more than the early
ones. Cutting the sequence into cp contiguous slices would give the last rank 2·cp − 1 times the
work of the first. Megatron-Core's context parallelism (and torchtitan's
"headtail" load balancer) cut it into 2·cp chunks of c = s / (2·cp) tokens instead and give rank r

    chunk r  and  chunk 2·cp − 1 − r        (positions [r·c, (r+1)·c) and [(2cp−1−r)·c, (2cp−r)·c))

an early chunk and its mirror image at the end, so every rank does the same work (the count is in
docs/theory/context.md). A rank's two chunks sit side by side in its local sequence, early one
first, so that local order is still increasing global position.

Both context-parallel attentions (the ring and the all-to-all) use this one layout, so a strategy
cuts its batch once the same way for either. Everything here is a pure function of (rank, cp, s).
"""

from __future__ import annotations

import torch

SEQ_DIM = 1  # batch tensors are (batch, seq, ...): token ids, targets, hidden states


def check_divisible(seq_len: int, cp: int) -> None:
    """The layout needs 2·cp equal chunks (Megatron-Core requires the same: s % (2·cp) == 0)."""
    if cp < 1 or seq_len % (2 * cp):
        multiple = 2 * max(cp, 1)
        raise ValueError(
            f"model.seq_len={seq_len} is not divisible by 2 x cp = {multiple}: the load-balanced layout cuts the "
            f"sequence into 2·cp equal chunks; use a seq_len that is a multiple of {multiple} "
            f"(e.g. {max(multiple, seq_len // multiple * multiple)})"
        )


def chunk_size(seq_len: int, cp: int) -> int:
    check_divisible(seq_len, cp)
    return seq_len // (2 * cp)


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices rank `rank` holds, early one first: (r, 2·cp − 1 − r)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {cp}")
    return rank, 2 * cp - 1 - rank


def rank_positions(rank: int, cp: int, seq_len: int, device=None) -> torch.Tensor:
    """The global token positions rank `rank` holds, in its local order (2·c of them).

    What the position embedding must see on this rank instead of arange(local length).
    """
    c = chunk_size(seq_len, cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(rank, cp)])


def layout_order(cp: int, seq_len: int, device=None) -> torch.Tensor:
    """The global position of every token when the ranks' local sequences are laid end to end,
    rank 0 first: what an all-gather (or an all-to-all) along the sequence assembles."""
    return torch.cat([rank_positions(r, cp, seq_len, device) for r in range(cp)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (its two chunks, concatenated along `dim`)."""
    c = chunk_size(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in rank_chunks(rank, cp)], dim=dim)


def validate(kind: str, cp: int, seq_len: int, heads: int, attention_dropout: float = 0.0,
             kv_heads: int | None = None) -> None:
    """Refuse, with one line that names the value and the fix, a layout the attention cannot run.

    kind: "ring" or "a2a". heads, kv_heads: the query and K/V heads this rank's attention holds
    (n_heads / tp and the kv heads per tp rank under tensor parallelism; kv_heads defaults to
    heads). Raises ValueError; the caller turns it into its `error:` line before any process group exists.
    """
    if kind not in ("ring", "a2a"):
        raise ValueError(f"context-parallel kind {kind!r} is not one of ring, a2a")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"parallel.cp={cp!r} must be a positive integer")
    check_divisible(seq_len, cp)
    if kind == "a2a":
        check_heads_split(cp, heads, heads if kv_heads is None else kv_heads)
    if kind == "ring" and attention_dropout > 0:
        raise ValueError(
            f"model.dropout={attention_dropout} inside attention: ring attention computes the softmax block by "
            "block and has no attention dropout; set model.dropout=0"
        )


def check_heads_split(cp: int, heads: int, kv_heads: int) -> None:
    """The all-to-all hands each rank heads/cp whole query heads and the kv heads they read: cp
    must divide the heads, and divide the kv heads or be a multiple of them (each kv head then
    replicated on cp/kv ranks). The ring has no head rule: it cuts the sequence only."""
    if heads % cp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"parallel.cp={cp} does not divide the {heads} attention heads per rank: the all-to-all gives each "
            f"rank heads/cp whole heads; use cp in {divisors}, or the ring (parallel=cp)"
        )
    if kv_heads % cp and cp % kv_heads:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        raise ValueError(
            f"parallel.cp={cp} neither divides nor is a multiple of the {kv_heads} K/V heads per rank "
            f"(model.n_kv_heads over tp): the all-to-all gives each rank kv heads/cp whole kv heads, or one "
            f"replica where cp is a multiple of them; use cp in {fits}, or the ring (parallel=cp)"
        )
