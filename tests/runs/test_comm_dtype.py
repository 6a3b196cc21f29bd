"""parallel.comm_dtype on runs: the bytes of every lossy format equal the closed form, for dp, zero2
and zero3, on both model shapes, and torch_ddp's bf16 hook is counted as dp's bf16 all-reduce.

Every case is a 3-step world-4 run (2 microbatches) forked from one pool of 4 ranks
(parallel/compare/pool.py), so the imports are paid once. Each case checks:
  * the log's bytes per step equal the registry's theory exactly (comm_matches_theory), and the
    closed form written out here from docs/low-precision-collectives.md:
      bf16   dp: 2(N-1)/N·2Ψ per rank; zero: G = 2Ψ_pad (and zero3's P)
      int8,  per part N chunks of c = Ψ_part,pad/N elements, each c bytes and 4·ceil(c/256) of
      fp8    scales: W = Σ_parts N·(c + 4·ceil(c/256)); dp sends (N-1)/N·W twice (an all-to-all,
             then an all-gather), zero2 m·(N-1)/N·W (all-to-all) + (N-1)/N·4Ψ_pad (fp32 weights),
             zero3 m·(N-1)/N·W + 2m·(N-1)/N·W
  * the ops that carried them (an all-to-all in place of a reduce-scatter for int8 and fp8);
  * the losses stay near fp32 dp's on the same model (within 1%: three steps of a lossy sum move
    them far less; a sync that lost a factor of N would not);
  * torch_ddp with PyTorch's bf16_compress_hook and dp's bf16 all-reduce, the same arithmetic on
    buckets that differ only in DDP's first step, give losses within 1e-4 of each other.
comm_dtype=fp32 is no wrapper at all (tests/layers/test_lowprec_collectives.py): the runs of test_dp.py and
test_zero.py are its runs.
"""

from fractions import Fraction

import pytest
from launcher import Run, assert_ok, run_train, tiny_settings

from parallel.compare.pool import Pool, pools_supported

N, M = 4, 2
V, H, S, L = 256, 64, 32, 4
H_KV, F = 32, 192
PARTS = {  # the embedding, a Block, the head (as tests/runs/test_zero.py writes them)
    "tiny": (V * H + S * H, 12 * H * H + 13 * H, 2 * H + V * H),
    "tiny_llama": (V * H, 2 * H + 2 * H * H + 2 * H * H_KV + 3 * H * F, H + V * H),
}
CASES = [  # (strategy, model, comm_dtype)
    ("dp", "tiny", "bf16"), ("dp", "tiny_llama", "int8"), ("dp", "tiny", "fp8"),
    ("zero2", "tiny_llama", "bf16"), ("zero2", "tiny", "int8"), ("zero2", "tiny_llama", "fp8"),
    ("zero3", "tiny", "bf16"), ("zero3", "tiny_llama", "int8"), ("zero3", "tiny", "fp8"),
    ("torch_ddp", "tiny", "bf16"),
]
REFERENCES = [("dp", "tiny", "fp32"), ("dp", "tiny_llama", "fp32")]


def _config(strategy: str, model: str, fmt: str) -> list[str]:
    return tiny_settings([f"model={model}", f"parallel={strategy}", f"parallel.comm_dtype={fmt}", "train.steps=3",
                          f"parallel.microbatches={M}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple, dict]:
    root = tmp_path_factory.mktemp("lowprec")
    cases = CASES + REFERENCES
    if not pools_supported():
        return {case: assert_ok(run_train(N, _config(*case), root / "_".join(case))) for case in cases}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the pool's ranks inherit this environment: gloo on the CPU
        with Pool(N) as pool:
            for case in cases:
                run_dir = root / "_".join(case)
                status, error, _ = pool.run(["launch.train", case[0]], [*_config(*case), f"run.dir={run_dir}"],
                                            run_dir, 240)
                assert (status, error) == ("ok", ""), (case, error)
    return {case: Run(0, "", "", root / "_".join(case)).summary for case in cases}


def _parts(model: str) -> list[int]:
    embed, block, head = PARTS[model]
    return [embed, *[block] * L, head]


def _scaled_bytes(model: str) -> int:
    """W: every part's N chunks, each c bytes and a 4-byte scale per started block of 256."""
    chunks = [-(-p // N) for p in _parts(model)]
    return sum(N * (c + 4 * -(-c // 256)) for c in chunks)


def _expected_sent_per_rank(strategy: str, model: str, fmt: str) -> tuple[Fraction, set[str]]:
    psi, psi_pad = sum(_parts(model)), sum(-(-p // N) * N for p in _parts(model))
    ring, half = Fraction(N - 1, N), fmt in ("int8", "fp8")
    wire = _scaled_bytes(model) if half else 2 * psi_pad
    scatter = "all_to_all" if half else "reduce_scatter"
    if strategy in ("dp", "torch_ddp"):
        return (2 * ring * _scaled_bytes(model), {"all_to_all", "all_gather"}) if half else \
            (2 * ring * 2 * psi, {"all_reduce"})
    if strategy == "zero2":
        return M * ring * wire + ring * 4 * psi_pad, {scatter, "all_gather"}
    return M * ring * wire + 2 * M * ring * wire, {scatter, "all_gather"}


@pytest.mark.parametrize("strategy,model,fmt", CASES)
def test_lossy_formats_send_the_closed_form(strategy, model, fmt, runs):
    s = runs[(strategy, model, fmt)]
    assert s["strategy"] == strategy and s["parallel"]["comm_dtype"] == fmt
    assert s["comm_matches_theory"] is True, (s["comm"]["sent_bytes_per_step_exact"],
                                              s["expected_comm"]["sent_bytes_per_step_exact"])
    per_rank, ops = _expected_sent_per_rank(strategy, model, fmt)
    assert Fraction(s["comm"]["sent_bytes_per_step_exact"]) == per_rank * N
    assert set(s["comm"]["by_op"]) == ops
    reference = runs[("dp", model, "fp32")]["losses"]
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(s["losses"], reference)), (s["losses"], reference)



def test_torch_ddp_bf16_hook_and_dp_bf16_agree(runs):
    ours, theirs = runs[("dp", "tiny", "bf16")]["losses"], runs[("torch_ddp", "tiny", "bf16")]["losses"]
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
