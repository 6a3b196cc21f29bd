"""How the FSDP2 baseline groups a checkpoint's full tensors into all-gathers (no process group:
parallel/baselines/fsdp2.py's gather_buckets on shapes with known answers). The gather itself is
checked against the single-process run by tests/helpers/checkpoint_every_strategy.py, with a
bucket small enough that it takes several."""

import torch

from parallel.baselines.fsdp2 import GATHER_BUCKET_BYTES, gather_buckets


def _shards(shapes: dict[str, tuple], n: int, dtype=torch.float32):
    """Each tensor's rank-0 shard as FSDP2 cuts it, and the full shapes."""
    full = {name: torch.Size(shape) for name, shape in shapes.items()}
    local = {name: torch.zeros((-(-shape[0] // n), *shape[1:]), dtype=dtype) for name, shape in shapes.items()}
    return local, full


def test_tensors_fill_a_bucket_in_order_padded_to_whole_rows_per_rank():
    # At n = 4: a (10, 8) tensor pads to 3 rows a rank, 4 x 3 x 8 x 4 B = 384 B gathered; (8,) pads
    # to 2 a rank, 32 B; (4, 8) needs no padding, 128 B.
    local, full = _shards({"a": (10, 8), "b": (8,), "c": (4, 8), "d": (10, 8)}, 4)
    assert gather_buckets(local, full, 4, cap=384 + 32 + 128) == [["a", "b", "c"], ["d"]]
    assert gather_buckets(local, full, 4, cap=384 + 32) == [["a", "b"], ["c"], ["d"]]
    # A tensor larger than the cap is gathered alone; nothing is split.
    assert gather_buckets(local, full, 4, cap=100) == [["a"], ["b"], ["c"], ["d"]]
    # The default holds a small model's whole state in one gather.
    assert gather_buckets(local, full, 4) == [["a", "b", "c", "d"]] and GATHER_BUCKET_BYTES == 64 * 2**20


def test_a_change_of_dtype_starts_a_new_bucket():
    local, full = _shards({"a": (4, 4), "b": (4, 4)}, 2)
    half, half_full = _shards({"h": (4, 4)}, 2, dtype=torch.bfloat16)
    tensors = {"a": local["a"], "h": half["h"], "b": local["b"]}
    assert gather_buckets(tensors, {**full, **half_full}, 2) == [["a"], ["h"], ["b"]]
