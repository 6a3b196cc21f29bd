"""HSDP (`hsdp`, `hsdp_zero2`) and its PyTorch counterpart (`torch_hsdp`) against the single run and theory.

Every case (four runs, on both model shapes) runs at world 4 with parallel.dp_shard=2 (shard groups
{0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}), forked one after another from one pool of 4
ranks (parallel/compare/pool.py), and checks:
  * per-step losses within 1e-5 relative of the single-process run, and the same final parameters;
  * the bytes logged per group equal the closed form, written out here on its own: with S = 2 ranks
    per shard group, R = 2 shard groups, m microbatches and P = G = 4·Ψ_S (Ψ_S: Ψ padded for S),
    each rank sends in its shard group ZeRO-3's m·(S-1)/S·(2P + G) (hsdp) or ZeRO-2's
    (S-1)/S·(m·G + P) (hsdp_zero2), and in its replicate group one all-reduce of its gradient
    shard per step, 2(R-1)/R·G/S; torch_hsdp the same on FSDP2's padded sizes (the root gathered once);
  * our strategies' model state per rank equals ZeRO's formula over the S ranks of a shard group.
The tiny model's parts are multiples of 64 elements: Ψ_S = Ψ for S = 2, no padding.
"""

from fractions import Fraction

import pytest
from launcher import TINY, TINY_LLAMA, Run, assert_ok, check_matches_single, max_rel_diff, run_train
from test_zero import PARTS, L, padded_psi

from parallel.compare.pool import Pool, pools_supported

S, R = 2, 2
# (preset, model, microbatches): the Llama shape under ZeRO-3, GPT-2's under ZeRO-2 and FSDP2, each accumulating
# two microbatches, and FSDP2 on the Llama shape with one (`hsdp` on GPT-2's with one microbatch is
# tests/tools/test_net.py's hsdp-2x2; `hsdp_zero2` on the Llama shape is the resumed case, below).
CASES = [("hsdp", "tiny_llama", 2), ("hsdp_zero2", "tiny", 2), ("torch_hsdp", "tiny", 2),
         ("torch_hsdp", "tiny_llama", 1)]


# The ZeRO-3 case also saves a sharded checkpoint after step 3 (saving changes no bit of the run); RESUMED
# loads it under ZeRO-2 and trains steps 3..5: each shard written once, by the first replica that holds it.
SAVES = ["train.checkpoint_every=3", "train.checkpoint_sharded=true"]
RESUMED = ("hsdp_zero2", "tiny_llama", 1)


def _config(preset: str, model: str, microbatches: int, root=None) -> list[str]:
    base = TINY_LLAMA if model == "tiny_llama" else TINY
    config = [*base, f"parallel={preset}", f"parallel.dp_shard={S}", f"parallel.microbatches={microbatches}",
              "train.save_final=true"]
    if (preset, model, microbatches) == CASES[0]:
        config += SAVES
    if (preset, model, microbatches) == RESUMED:
        config += [f"train.resume={root / _key(*CASES[0]) / 'checkpoints' / 'step_000003'}"]
    return config


def _key(preset: str, model: str, microbatches: int) -> str:
    return f"{preset}-{model}-m{microbatches}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Every case's run, from one pool of 4 ranks where pools work (imports paid once)."""
    root = tmp_path_factory.mktemp("hsdp")
    cases = [*CASES, RESUMED]
    if not pools_supported():
        return {_key(*case): run_train(4, _config(*case, root), root / _key(*case)) for case in cases}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the pool's ranks inherit this environment: gloo on the CPU
        with Pool(4) as pool:
            for case in cases:
                key = _key(*case)
                status, error, _ = pool.run(["launch.train", case[0]],
                                            [*_config(*case, root), f"run.dir={root / key}"], root / key, 240)
                assert (status, error) == ("ok", ""), (key, error)
    return {_key(*case): Run(0, "", "", root / _key(*case)) for case in cases}


def expected_per_rank(preset: str, model: str, m: int) -> dict[str, Fraction]:
    """Bytes each rank sends per step in its shard group and in its replicate group."""
    if preset == "torch_hsdp":
        # FSDP2 pads each parameter to S·ceil(d0/S) rows: every d0 of tiny is even, so nothing for S = 2.
        embed, block, head = PARTS[model]
        blocks, root = 4 * L * block, 4 * (embed + head)
        shard = Fraction(S - 1, S) * m * (2 * blocks + root + blocks + root)
        gradient_shard = Fraction(blocks + root, S)
    else:
        P = G = 4 * padded_psi(S, model)
        shard = (m * Fraction(S - 1, S) * (2 * P + G) if preset == "hsdp"
                 else Fraction(S - 1, S) * (m * G + P))
        gradient_shard = Fraction(G, S)
    return {"dp_shard": shard, "dp_replicate": Fraction(2 * (R - 1), R) * gradient_shard}


@pytest.mark.parametrize("preset,model,microbatches", CASES)
def test_hsdp_matches_single_and_the_bytes_per_group(preset, model, microbatches, runs, request):
    run = runs[_key(preset, model, microbatches)]
    s = assert_ok(run)
    assert s["strategy"] == preset and s["parallel"]["dp"] == 4
    check_matches_single(run, request.getfixturevalue("single_run_llama" if model == "tiny_llama" else "single_run"))
    comm = s["comm"]
    expected = expected_per_rank(preset, model, microbatches)
    all_ranks = {g: 4 * v for g, v in expected.items()}
    assert {g: Fraction(v["sent_bytes"]) for g, v in comm["by_group"].items()} == all_ranks
    assert {g: Fraction(v["sent_bytes_exact"]) for g, v in s["expected_comm"]["by_group"].items()} == all_ranks
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    assert set(comm["by_op"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    # One all-reduce of the gradient shards per step, whatever the microbatches: ours one per part, FSDP2's per unit.
    units = L + (1 if preset == "torch_hsdp" else 2)
    tag = "fsdp2/grad_all_reduce" if preset == "torch_hsdp" else "hsdp/grad_all_reduce/blocks.0"
    assert comm["by_tag"][tag]["calls"] == (units if preset == "torch_hsdp" else 1) * 4
    if preset != "torch_hsdp":
        memory = s["memory"]
        assert memory["matches_formula"] is True
        psi = padded_psi(S, model)
        params = 4 * psi // S if preset == "hsdp" else 4 * psi
        for row in memory["by_rank"]:
            assert (row["param_bytes"], row["grad_bytes"], row["optimizer_bytes"]) == (params, 4 * psi // S,
                                                                                       8 * psi // S), row


def test_hsdp_sharded_checkpoint_resumes_under_zero2(runs, single_run_llama):
    """Saved by ZeRO-3 in shard groups of 2 (the second replica writes no piece: a tensor covered twice
    is refused on loading), loaded by hsdp_zero2: the resumed steps are the single run's."""
    s = assert_ok(runs[_key(*RESUMED)])
    assert s["strategy"] == "hsdp_zero2" and s["first_step"] == 3
    assert max_rel_diff(s["losses"], single_run_llama.summary["losses"][3:]) < 1e-5
