"""The sharded strategies' copies: the elementwise work around ZeRO-2/3's and FSDP2's collectives.

A sharded strategy moves its gradients and parameters between the model's tensors and the flat
buffers its collectives send, on the rank's own cores (or its GPU's memory), every microbatch:

    ours (parallel/sync/shards.py's GradReduceScatter: zero2, zero3, hsdp, hsdp_zero2, combined
    layouts with parallel.zero=2)
        per microbatch   each part's full gradient buffer zeroed, each gradient copied into it,
                         and the reduce-scattered 1/n added into the rank's gradient shard
        per step         the gradient shards zeroed (1/n)
    FSDP2 (the registry's "fsdp2" tag: torch_fsdp2, torch_hsdp, torch_zero2; torch.distributed.fsdp's own ops)
        per gather       all_gather_copy_in (the rank's 1/n into the gather's input) and
                         split_with_sizes_copy (the gathered buffer out into the parameters)
        per microbatch   chunk_cat (the gradients into the reduce-scatter's input), and from the
                         second microbatch on the reduce-scattered 1/n added into the sharded gradient

ZeRO-3's own gathers and every reduce-scatter write straight into the buffers they use, so they add
no pass. FSDP2 gathers each Block before its forward and again before its backward and the root
(embedding and head) once per microbatch; torch_zero2 (tagged "keeps_gathered") once per step. Each
pass reads and writes every element it touches once; the seconds are

    elements x bytes per element / rate      (codec.py's Pass and rate: HBM, or this machine's probe)

with the elements the rank's parts' (the whole model for these strategies). What the transport does
posting a collective (gloo's own copies) is the link's, timed with it.
"""

from __future__ import annotations

from fractions import Fraction

from parallel.planner.codec import Pass, elementwise_seconds


def shard_add(n: int) -> Pass:
    return Pass("shard += the reduce-scattered 1/n", 8, 4, Fraction(1, n))


def ours_per_microbatch(n: int) -> list[Pass]:
    return [Pass("zeroed gradient buffer", 0, 4), Pass("gradient copied into the buffer", 4, 4), shard_add(n)]


def ours_per_step(n: int) -> list[Pass]:
    return [Pass("gradient shards zeroed", 0, 4, Fraction(1, n))]


def fsdp2_per_gather(n: int) -> list[Pass]:
    return [Pass("all_gather_copy_in: the shard into the gather's input", 4, 4, Fraction(1, n)),
            Pass("split_with_sizes_copy: the gathered buffer into the parameters", 4, 4)]


FSDP2_PER_MICROBATCH = [Pass("chunk_cat: the gradients into the reduce-scatter's input", 4, 4)]


def copy_passes(tags, zero: int, n: int, m: int, parts: list[int]) -> list[tuple[list[Pass], Fraction]]:
    """(passes, calls per step) of a strategy (its registry `tags`: FSDP2's, or ours) sharding over n ranks
    with m microbatches; each call's passes are per element of the rank's parts (embedding, blocks, head)."""
    if n <= 1:
        return []
    if "fsdp2" in tags:
        blocks = Fraction(sum(parts[1:-1]), sum(parts))  # the Blocks' share; the root holds the rest
        gathers = Fraction(1) if "keeps_gathered" in tags else m * (2 * blocks + (1 - blocks))
        return [(fsdp2_per_gather(n), gathers), (FSDP2_PER_MICROBATCH, Fraction(m)), ([shard_add(n)], Fraction(m - 1))]
    if zero in (2, 3) and "baseline" not in tags:
        return [(ours_per_microbatch(n), Fraction(m)), (ours_per_step(n), Fraction(1))]
    return []


def copy_seconds(tags, zero: int, n: int, m: int, parts: list[int], rate: float | None) -> float:
    """One rank's copies per step at the codec rate (0 where there is none)."""
    return elementwise_seconds(copy_passes(tags, zero, n, m, parts), sum(parts), rate)
