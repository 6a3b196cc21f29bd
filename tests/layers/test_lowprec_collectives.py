"""The low-precision collectives (parallel/sync/lowprec.py) on 4 gloo ranks, against the fp32 ones.

Every rank builds every rank's input from that rank's seed (blocks of very different magnitudes,
one block of zeros), so each can compute the exact sum and the bound parallel/sync/quantize.py
states for it. One spawn checks, for bf16, int8 and fp8:
  * all-reduce, reduce-scatter and all-gather land within the format's stated error bound of the
    Communicator's fp32 collective (plus fp32's own rounding of a sum, 1e-6 of the magnitudes);
  * the bound is not vacuous: the error reaches a tenth of it somewhere;
  * every rank holds the same all-reduced values (the chunk's owner too);
  * the bytes the log records are the closed form: algebra.wire_bytes per chunk, scales counted;
  * ZeRO's memory meter counts the wire copies while they live, and none is left after;
  * error feedback: the mean of 8 int8 all-reduces of the same gradients is 4x closer to the exact
    sum than one is (the residual is carried to the next call);
and that fp32 is no wrapper at all: `collectives` hands back the Communicator itself.
"""

from __future__ import annotations

import torch
from spawn import run_ranks, write_result

from parallel.algebra import wire_bytes
from parallel.dist.comm import CommLog, Communicator
from parallel.sync.lowprec import collectives
from parallel.sync.quantize import all_reduce_error_bound, chunked_error_bound, sum_error_bound
from parallel.sync.shards import MemoryMeter

WORLD, ODD, EVEN = 4, 1001, 1200  # an all-reduce length N does not divide, a reduce-scatter's that it does
FORMATS = ("bf16", "int8", "fp8")


def _input(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=g)
    magnitudes = 10.0 ** torch.randint(-4, 2, (numel // 64 + 1,), generator=g).float()
    x *= magnitudes.repeat_interleave(64)[:numel]
    x[256:512] = 0
    return x


def _compare(lossy: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, magnitudes: torch.Tensor) -> dict:
    err = (lossy - exact).abs()
    return {"within": bool((err <= bound + 1e-6 * magnitudes).all()),
            "reaches": float((err / bound.clamp_min(1e-30)).max())}


def _bytes(log: CommLog, op: str, tag: str) -> int:
    return sum(t.payload_bytes for (o, _, g), t in log.outside.items() if o == op and g == tag)


def _check_format(fmt: str, comm: Communicator, log: CommLog, rank: int) -> dict:
    meter = MemoryMeter()
    wire = collectives(comm, fmt, error_feedback=True, meter=meter)
    inputs = [_input(r, ODD) for r in range(WORLD)]
    magnitudes = sum(x.abs() for x in inputs)
    fp32 = inputs[rank].clone()
    comm.all_reduce(fp32, tag="fp32")
    lossy = inputs[rank].clone()
    wire.all_reduce(lossy, tag=f"{fmt}/all_reduce")
    padded = -(-ODD // WORLD) * WORLD
    pad = [torch.cat([x, torch.zeros(padded - ODD)]) for x in inputs]
    exact = sum(pad)
    out = {"all_reduce": _compare(lossy, fp32, all_reduce_error_bound(pad, exact, fmt)[:ODD], magnitudes),
           "all_reduce_values": lossy.tolist()}
    chunk = EVEN // WORLD
    full = [_input(r, EVEN) for r in range(WORLD)]
    mine = slice(rank * chunk, (rank + 1) * chunk)
    fp32_shard, lossy_shard = torch.empty(chunk), torch.empty(chunk)
    comm.reduce_scatter(fp32_shard, full[rank].clone(), tag="fp32")
    wire.reduce_scatter(lossy_shard, full[rank].clone(), tag=f"{fmt}/reduce_scatter", async_op=True).wait()
    out["reduce_scatter"] = _compare(lossy_shard, fp32_shard, sum_error_bound(full, fmt)[mine],
                                     sum(x.abs() for x in full)[mine])
    gathered, fp32_gathered = torch.empty(EVEN), torch.empty(EVEN)
    comm.all_gather_into(fp32_gathered, full[rank][mine].clone(), tag="fp32")
    wire.all_gather_into(gathered, full[rank][mine].clone(), tag=f"{fmt}/all_gather")
    expected = torch.cat([x[r * chunk:(r + 1) * chunk] for r, x in enumerate(full)])
    out["all_gather"] = _compare(gathered, fp32_gathered, chunked_error_bound(expected, fmt, WORLD), expected.abs())
    scattered = "all_to_all" if fmt != "bf16" else "reduce_scatter"
    out["bytes"] = {"all_reduce": sum(_bytes(log, op, f"{fmt}/all_reduce") for op in ("all_to_all", "all_reduce",
                                                                                        "all_gather")),
                    "reduce_scatter": _bytes(log, scattered, f"{fmt}/reduce_scatter"),
                    "all_gather": _bytes(log, "all_gather", f"{fmt}/all_gather")}
    out["meter"] = [meter.current, meter.peak]
    return out


def _error_feedback(comm: Communicator, rank: int) -> dict:
    """8 int8 all-reduces of the same gradients: one's error, and the error of their mean."""
    wire = collectives(comm, "int8", error_feedback=True)
    inputs = [_input(r, ODD) for r in range(WORLD)]
    exact = sum(inputs)
    results = []
    for _ in range(8):
        x = inputs[rank].clone()
        wire.all_reduce(x, tag="feedback")
        results.append(x)
    return {"one": float((results[0] - exact).abs().max()), "mean": float((sum(results) / 8 - exact).abs().max())}


def _ranks(rank, world, out_dir):
    import torch.distributed as dist

    log = CommLog(timed=False)
    comm = Communicator("dp", dist.group.WORLD, log)
    result = {fmt: _check_format(fmt, comm, log, rank) for fmt in FORMATS}
    result["feedback"] = _error_feedback(comm, rank)
    result["fp32_is_the_communicator"] = collectives(comm, "fp32") is comm
    write_result(out_dir, rank, result)


def test_lossy_collectives_stay_within_their_bounds_and_send_the_closed_form():
    results = run_ranks(WORLD, _ranks)
    chunk = -(-ODD // WORLD)
    for fmt in FORMATS:
        for rank, r in enumerate(results):
            for op in ("all_reduce", "reduce_scatter", "all_gather"):
                assert r[fmt][op]["within"], (fmt, op, rank, r[fmt][op])
                assert r[fmt][op]["reaches"] > 0.1, (fmt, op, rank, r[fmt][op])
            assert r[fmt]["all_reduce_values"] == results[0][fmt]["all_reduce_values"], (fmt, rank)
            if fmt == "bf16":
                expected = {"all_reduce": 2 * ODD, "reduce_scatter": 2 * EVEN, "all_gather": 2 * EVEN}
            else:
                expected = {"all_reduce": 2 * WORLD * wire_bytes(fmt, chunk),
                            "reduce_scatter": WORLD * wire_bytes(fmt, EVEN // WORLD),
                            "all_gather": WORLD * wire_bytes(fmt, EVEN // WORLD)}
            assert r[fmt]["bytes"] == expected, (fmt, rank)
            # ZeRO's meter holds the wire copies while they live: at most the reduce-scatter's two
            # (bf16: its input and output; int8/fp8: the bytes sent and received), none after.
            two_copies = 2 * EVEN + 2 * EVEN // WORLD if fmt == "bf16" else 2 * WORLD * wire_bytes(fmt, EVEN // WORLD)
            assert r[fmt]["meter"] == [0, two_copies], (fmt, rank)
    # Written out: an int8 chunk of 251 elements is 251 bytes and one 4-byte scale; one of 300, two.
    assert wire_bytes("int8", chunk) == 251 + 4 and wire_bytes("fp8", EVEN // WORLD) == 300 + 2 * 4
    for r in results:
        assert r["feedback"]["mean"] < r["feedback"]["one"] / 4, r["feedback"]
        assert r["fp32_is_the_communicator"]
