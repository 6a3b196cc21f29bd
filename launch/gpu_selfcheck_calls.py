"""Every call of the Communicator (parallel/dist/comm.py) once, on a one-rank group, on the device's
tensors in the dtypes the strategies send (fp32, and bf16 under mixed precision), each result
checked: over one rank a sum, a maximum, a gather, a reduce-scatter and a broadcast give the input
back, an all-to-all keeps every block in place, and a message sent to oneself arrives.

A call the backend cannot make on these tensors (a CPU tensor on an NCCL group, a dtype or an op it
does not implement) fails here with the backend's own message. Used by launch/gpu_selfcheck.py.
"""

from __future__ import annotations

import sys
import traceback

import torch

from parallel.dist.comm import Communicator


def _filled(device: torch.device, dtype=torch.float32, n: int = 1024) -> torch.Tensor:
    return torch.arange(n, device=device, dtype=torch.float32).to(dtype)


def _reductions(comm: Communicator, device: torch.device) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = _filled(device, dtype)
        comm.all_reduce(x, tag="selfcheck/sum")
        torch.testing.assert_close(x, _filled(device, dtype))
    x = _filled(device)
    comm.all_reduce(x, tag="selfcheck/max", op="max")
    comm.all_reduce(x, tag="selfcheck/async", async_op=True).wait()
    torch.testing.assert_close(x, _filled(device))
    future = comm.all_reduce_future(_filled(device), tag="selfcheck/future")
    torch.testing.assert_close(future.wait(), _filled(device))


def _gathers(comm: Communicator, device: torch.device) -> None:
    out = torch.empty(1024, device=device)
    comm.all_gather_into(out, _filled(device), tag="selfcheck/gather")
    torch.testing.assert_close(out, _filled(device))
    shard = torch.empty(1024, device=device)
    comm.reduce_scatter(shard, _filled(device), tag="selfcheck/scatter")
    torch.testing.assert_close(shard, _filled(device))
    x = _filled(device)
    comm.broadcast(x, 0, tag="selfcheck/broadcast")
    torch.testing.assert_close(x, _filled(device))


def _all_to_all(comm: Communicator, device: torch.device) -> None:
    rows = _filled(device, n=64).reshape(16, 4)
    out = torch.empty_like(rows)
    comm.all_to_all_single(out, rows, tag="selfcheck/a2a")
    torch.testing.assert_close(out, rows)
    out = torch.empty_like(rows)
    comm.all_to_all_single(out, rows, tag="selfcheck/a2a_splits", output_split_sizes=[16], input_split_sizes=[16])
    torch.testing.assert_close(out, rows)


def _point_to_point(comm: Communicator, device: torch.device) -> str | None:
    """A pipeline's batched exchange, to oneself: one send and one receive posted together (NCCL
    takes a message to oneself; gloo has no connection to itself, so its dry run says so)."""
    if device.type != "cuda":
        return "gloo has no connection from a rank to itself (the 2-rank runs send and receive on gloo)"
    sent, got = _filled(device), torch.zeros(1024, device=device)
    for handle in comm.batch_p2p([("send", sent, 0, "selfcheck/p2p"), ("recv", got, 0, "selfcheck/p2p")]):
        handle.wait()
    torch.testing.assert_close(got, sent)
    return None


def _objects(comm: Communicator, device: torch.device) -> None:
    """The tooling's object calls (run directory, every rank's report), which under NCCL travel as
    CUDA tensors torch makes for them."""
    assert comm.broadcast_object({"run": "dir"}, 0, tag="tooling/selfcheck") == {"run": "dir"}
    assert comm.gather_object([1, 2], 0, tag="tooling/selfcheck") == [[1, 2]]
    comm.barrier(tag="tooling/selfcheck")


CHECKS = {"all_reduce (fp32, bf16, max, async, future)": _reductions,
          "all_gather, reduce_scatter, broadcast": _gathers,
          "all_to_all (even and given splits)": _all_to_all,
          "batch_p2p (send and receive to oneself)": _point_to_point,
          "objects and barrier (tooling)": _objects}


def check_calls(comm: Communicator, device: torch.device) -> list[bool]:
    """Each group of calls on `comm`, one line each; whether each passed."""
    results = []
    for name, check in CHECKS.items():
        try:
            skipped = check(comm, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if skipped:
                print(f"skip calls {name} on {device}: {skipped}", flush=True)
                continue
            print(f"ok   calls {name} on {device}", flush=True)
            results.append(True)
        except Exception as e:  # noqa: BLE001 - one line per group of calls, then the next
            print(f"FAIL calls {name} on {device}: {type(e).__name__}: {str(e).strip()[:300]}", flush=True)
            traceback.print_exc(file=sys.stderr)
            results.append(False)
    return results
