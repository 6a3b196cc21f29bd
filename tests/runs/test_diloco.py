"""DiLoCo against the single run, and its outer all-reduce's bytes against the closed form.

Six runs of the tiny models (6 steps), forked from one pool of ranks per world (parallel/compare/
pool.py) so that the imports are paid twice, not six times:
  * the proof it is built right: at world 4 with H = 1, an outer SGD of rate 1 without momentum and a
    plain SGD inner optimizer (train.optimizer=sgd), diloco's losses and final (outer) parameters
    equal the single run's with train.optimizer=sgd within 1e-5, on tiny and on tiny_llama;
  * the bytes: with H = 3 (AdamW inner, Nesterov outer; model tiny) every rank sends nothing for two
    steps and then 2(N-1)/N·Ψ·4 bytes, written out here; streaming with F = 2 (tiny_llama) sends each
    fragment's 2(N-1)/N·Ψ_f·4 at its own offset, and the summary's mean over the last H steps is the
    closed form per step, exactly.
"""

from fractions import Fraction

import pytest
from launcher import TINY, TINY_LLAMA, Run, assert_ok, check_matches_single, run_train

from parallel.compare.pool import Pool, pools_supported
from parallel.diloco.schedule import syncing
from parallel.diloco.theory import fragment_parameters
from parallel.dist.dims import ParallelDims
from parallel.registry import expected_comm, layout_of
from parallel.run_plan import model_config

SGD = ["train.optimizer=sgd", "train.save_final=true"]
H1 = ["parallel=diloco", "parallel.inner_steps=1", "parallel.outer_lr=1", "parallel.outer_momentum=0", *SGD]
CASES = {  # name -> (world, overrides)
    "single": (1, [*TINY, "parallel=single", *SGD]),
    "single_llama": (1, [*TINY_LLAMA, "parallel=single", *SGD]),
    "h1": (4, [*TINY, *H1]),
    "h1_llama": (4, [*TINY_LLAMA, *H1]),
    "h3": (4, [*TINY, "parallel=diloco", "parallel.inner_steps=3"]),
    "h3_f2_llama": (4, [*TINY_LLAMA, "parallel=diloco", "parallel.inner_steps=3", "parallel.fragments=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("diloco")
    if not pools_supported():
        for name, (world, args) in CASES.items():
            assert_ok(run_train(world, args, root / name))
        return {name: Run(0, "", "", root / name) for name in CASES}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the pool's ranks inherit this environment: gloo on the CPU
        for world in (1, 4):
            with Pool(world) as pool:
                for name, (w, args) in CASES.items():
                    if w == world:
                        status, error, _ = pool.run(["launch.train", name], [*args, f"run.dir={root / name}"],
                                                    root / name, 240)
                        assert (status, error) == ("ok", ""), (name, error)
    return {name: Run(0, "", "", root / name) for name in CASES}


@pytest.mark.parametrize("run,single", [("h1", "single"), ("h1_llama", "single_llama")])
def test_diloco_at_h1_with_sgd_is_the_single_run(runs, run, single):
    check_matches_single(runs[run], runs[single])
    s = runs[run].summary
    assert s["parallel"]["inner_steps"] == 1 and s["config"]["train"]["optimizer"] == "sgd"
    assert s["comm_matches_theory"] is True and s["comm"]["steady"] is True


def _sync_bytes(psi: int, world: int) -> Fraction:
    """One ring all-reduce of psi fp32 values over `world` ranks, all ranks: 2(N-1)/N·Ψ·4·N."""
    return Fraction(2 * (world - 1), world) * psi * 4 * world


def test_diloco_sends_the_whole_model_once_per_h_steps(runs):
    s = runs["h3"].summary
    comm, psi = s["comm"], s["model"]["parameters"]
    assert comm["sent_bytes_by_step"] == [0, 0, float(_sync_bytes(psi, 4))] * 2
    assert list(comm["by_tag"]) == ["diloco/fragment0"] and list(comm["by_group"]) == ["dp"]
    assert comm["run"]["by_group"]["dp"]["calls"] == 2 * 4  # two syncs, one all-reduce on each rank
    assert Fraction(s["expected_comm"]["sent_bytes_per_step_exact"]) == _sync_bytes(psi, 4) / 3
    assert s["expected_comm"]["period_steps"] == 3 and s["comm_matches_theory"] is True
    assert s["parallel"]["outer_momentum"] == 0.9 and s["config"]["train"]["optimizer"] == "adamw"


def test_streaming_diloco_sends_each_fragment_at_its_offset(runs):
    s = runs["h3_f2_llama"].summary
    model = model_config(s["config"]["model"])
    psi_f = fragment_parameters(model, 2)
    assert sum(psi_f) == s["model"]["parameters"] and psi_f[0] != psi_f[1]
    # Fragment 0 at steps 3, 6 (counted from 1); fragment 1 at its offset floor(1·3/2) = 1: steps 1, 4.
    assert [syncing(t, 3, 2) for t in range(1, 7)] == [[1], [], [0], [1], [], [0]]
    per_step = [sum((_sync_bytes(psi_f[f], 4) for f in syncing(t, 3, 2)), Fraction(0)) for t in range(1, 7)]
    assert s["comm"]["sent_bytes_by_step"] == [float(b) for b in per_step]
    # Each sync moves one fragment (the peak falls by about F); any 3 steps move the whole model once.
    assert max(per_step) < _sync_bytes(s["model"]["parameters"], 4)
    assert sum(per_step[3:]) == _sync_bytes(s["model"]["parameters"], 4)
    theory = expected_comm("diloco", model, layout_of(ParallelDims.resolve(4), inner_steps=3, fragments=2))
    assert Fraction(theory["sent_bytes_per_step_exact"]) == sum(per_step[3:]) / 3
    assert s["comm_matches_theory"] is True

