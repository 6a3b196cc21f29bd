"""Context parallelism and activation recomputation, end to end under torchrun, against the single run.

Each case trains the tiny model (s = 32, L = 4, h = 64, 4 heads) for 6 steps on gloo, or its Llama
shape (model=tiny_llama: 2 K/V heads for the 4 query heads, SwiGLU, RMSNorm, rotary positions of the
load-balanced chunks), and checks at once:
  * per-step losses within 1e-5 relative of the single-process run and the same final parameters;
  * the bytes per step equal parallel/cp/theory.py exactly: in total, op by op (payload and sent) and
    group by group (cp, dp_cp, tp, pp), and the attention's calls per layer (the ring's sends, the
    all-to-alls, twice the forward's under recomputation);
  * the bytes saved for backward, measured on every rank, equal activations.activation_bytes exactly
    where the registry has the formula (cp, cp_a2a); the model state equals its formula.
Recomputation is spread over the cases so that each mode runs on cp and on tp (none, selective,
full): what it changes in memory is checked against the formula here, and in one process, for
every mode, in tests/unit/test_recompute.py.
"""

from fractions import Fraction

import pytest
from launcher import TINY, TINY_LLAMA, assert_ok, check_matches_single, run_train

L, S, H, HEADS = 4, 32, 64, 4  # the tiny model (and tiny_llama's, which has 2 K/V heads)
GLOBAL_BATCH = 16
LLAMA = "model=tiny_llama"  # a case's marker: it runs on TINY_LLAMA against its own single run

CASES = [
    # id, world, overrides, (dp, cp, tp, pp), cp kind, recompute, microbatches
    ("cp2-ring", 2, ["parallel=cp"], (1, 2, 1, 1), "ring", "none", 1),
    ("cp4-ring-full", 4, ["parallel=cp", "parallel.cp=4", "train.recompute=full"], (1, 4, 1, 1), "ring", "full", 1),
    ("cp2-a2a-selective", 2, ["parallel=cp_a2a", "train.recompute=selective"], (1, 2, 1, 1), "a2a", "selective", 1),
    ("cp4-a2a", 4, ["parallel=cp_a2a", "parallel.cp=4"], (1, 4, 1, 1), "a2a", "none", 1),
    ("dp2xcp2-ring-zero1-selective", 4, ["parallel=cp", "parallel.zero=1", "parallel.microbatches=2",
                                         "train.recompute=selective"], (2, 2, 1, 1), "ring", "selective", 2),
    ("cp2xtp2-ring", 4, ["parallel=cp", "parallel.tp=2"], (1, 2, 2, 1), "ring", "none", 1),
    ("cp2xtp2-a2a-sp-full", 4, ["parallel=cp_a2a", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "train.recompute=full"], (1, 2, 2, 1), "a2a", "full", 1),
    ("cp2xpp2-ring-full", 4, ["parallel=cp", "parallel.pp=2", "parallel.microbatches=2", "train.recompute=full"],
     (1, 2, 1, 2), "ring", "full", 2),
    # The column-parallel linears keep their piece of this rank's s/cp tokens and gather it again in backward.
    ("cp2xtp2-ring-sp-sharded", 4, ["parallel=cp", "parallel.tp=2", "parallel.sequence_parallel=true",
                                    "parallel.tp_saves=sharded"], (1, 2, 2, 1), "ring", "none", 1),
    ("llama-cp2xtp2-ring-sp-sharded", 4, [LLAMA, "parallel=cp", "parallel.tp=2", "parallel.sequence_parallel=true",
                                          "parallel.tp_saves=sharded"], (1, 2, 2, 1), "ring", "none", 1),
    ("tp2-selective", 2, ["parallel=tp", "train.recompute=selective"], (1, 1, 2, 1), None, "selective", 1),
    # Saving the sequence piece under full recomputation: the recomputed forward gathers, then the regathers.
    ("tp_sp2-sharded-full", 2, ["parallel=tp_sp", "parallel.tp_saves=sharded", "train.recompute=full"],
     (1, 1, 2, 1), None, "full", 1),
    # Llama's block: the ring passes 2 K/V heads (not 4) and rotates q, k by the chunks' global positions.
    ("llama-cp4-ring-full", 4, [LLAMA, "parallel=cp", "parallel.cp=4", "train.recompute=full"], (1, 4, 1, 1), "ring",
     "full", 1),
    ("llama-cp2-a2a-selective", 2, [LLAMA, "parallel=cp_a2a", "train.recompute=selective"], (1, 2, 1, 1), "a2a",
     "selective", 1),
    ("llama-dp2xcp2-a2a", 4, [LLAMA, "parallel=cp_a2a", "parallel.microbatches=2"], (2, 2, 1, 1), "a2a", "none", 2),
]


def kv_heads_of(overrides: list[str]) -> int:
    return 2 if LLAMA in overrides else HEADS


def check_traffic_equals_theory(s: dict) -> None:
    comm, expected = s["comm"], s["expected_comm"]
    assert s["comm_matches_theory"] is True and comm["steady"] is True
    assert set(comm["by_op"]) == set(expected["by_op"])
    for op, e in expected["by_op"].items():
        assert Fraction(comm["by_op"][op]["sent_bytes"]) == Fraction(e["sent_bytes_exact"]), op
        assert comm["by_op"][op]["payload_bytes"] == e["payload_bytes"], op
    assert set(comm["by_group"]) == set(expected["by_group"])
    for group, e in expected["by_group"].items():
        assert Fraction(comm["by_group"][group]["sent_bytes"]) == Fraction(e["sent_bytes_exact"]), group


def check_attention_calls(s: dict, world: int, cp: int, tp: int, pp: int, kind: str, recompute: str, m: int,
                          kv_heads: int = HEADS) -> None:
    """Per layer, per microbatch, on each rank that holds the layer: the ring posts cp − 1 sends of
    K, V forward (and again under recomputation) and 2(cp − 1) backward (K, V and the dK, dV
    accumulator); the all-to-all 2 calls each way. Each layer lives on world / pp ranks. K and V
    have `kv_heads` heads (cp divides them in these cases): the ring sends them unexpanded."""
    by = s["comm"]["by_tag_op"]
    forwards = 1 if recompute == "none" else 2
    holders = world // pp
    op, fwd, bwd = ("send", cp - 1, 2 * (cp - 1)) if kind == "ring" else ("all_to_all", 2, 2)
    b = GLOBAL_BATCH // (world // (cp * tp * pp)) // m
    head = b * (S // cp) * (H // HEADS)  # elements of one head on a rank
    u, u_kv = head * (HEADS // tp), head * (kv_heads // tp)  # of a rank's Q, and of its K or V
    for i in range(L):
        assert by[f"cp/blocks.{i}.attn/fwd"][op]["calls"] == forwards * fwd * m * holders, i
        assert by[f"cp/blocks.{i}.attn/bwd"][op]["calls"] == bwd * m * holders, i
    if kind == "ring":  # each forward send is K and V stacked: 2·U_kv fp32 elements
        sends = by["cp/blocks.0.attn/fwd"]["send"]
        assert sends["payload_bytes"] == sends["calls"] * 2 * u_kv * 4
    else:  # q, k, v (U + 2·U_kv) in, the output (U) back; (cp − 1)/cp of each leaves the rank
        a2a = by["cp/blocks.0.attn/fwd"]["all_to_all"]
        assert a2a["payload_bytes"] == forwards * m * holders * (2 * u + 2 * u_kv) * 4
        assert Fraction(a2a["sent_bytes"]) == Fraction(cp - 1, cp) * a2a["payload_bytes"]


def check_tp_recompute(s: dict, world: int, tp: int, recompute: str, m: int) -> None:
    """Full recomputation runs each block's forward collectives again in backward (tagged `fwd`):
    per layer 6 tensors of b·s·h instead of 4, i.e. 12·b·s·h·(t−1)/t sent per rank, not 8; saving
    the sequence piece (parallel.tp_saves=sharded) adds its 2 regathers, (t−1)/t each, whatever is
    recomputed."""
    by = s["comm"]["by_tag_op"]
    forwards = 2 if recompute == "full" else 1
    for i in range(L):
        for part in ("attn", "mlp"):
            fwd = sum(t["calls"] for t in by[f"tp/blocks.{i}.{part}/fwd"].values())
            bwd = sum(t["calls"] for t in by[f"tp/blocks.{i}.{part}/bwd"].values())
            assert fwd == forwards * bwd, (i, part, fwd, bwd)
    sent = sum(Fraction(t["sent_bytes"]) for tag, ops in by.items() if tag.startswith("tp/blocks.")
               for t in ops.values())
    cp = s["parallel"]["cp"]
    tokens = GLOBAL_BATCH // (world // (cp * tp)) // m * (S // cp)
    units = (12 if recompute == "full" else 8) + (2 if s["parallel"]["tp_saves"] == "sharded" else 0)
    assert sent == L * m * units * tokens * H * Fraction(tp - 1, tp) * 4 * world


@pytest.mark.parametrize("case_id,world,overrides,layout,kind,recompute,m", CASES, ids=[c[0] for c in CASES])
def test_cp_and_recompute_match_single_and_theory(pools, case_id, world, overrides, layout, kind, recompute, m, request,
                                                  tmp_path):
    llama = LLAMA in overrides
    single_run = request.getfixturevalue("single_run_llama" if llama else "single_run")
    given = [*(TINY_LLAMA if llama else TINY), *(o for o in overrides if o != LLAMA)]
    run = pools.run(world, [*given, "train.save_final=true"], tmp_path / "run", timeout=400)
    s = assert_ok(run)
    dp, cp, tp, pp = layout
    par = s["parallel"]
    assert (par["dp"], par["cp"], par["tp"], par["pp"], par["cp_kind"], par["recompute"]) == (dp, cp, tp, pp, kind,
                                                                                            recompute)
    assert s["strategy"] == ("tp" if cp == 1 else {"ring": "cp", "a2a": "cp_a2a"}[kind] if tp == pp == 1 else "3d")
    check_matches_single(run, single_run)
    check_traffic_equals_theory(s)
    if cp > 1:
        check_attention_calls(s, world, cp, tp, pp, kind, recompute, m, kv_heads_of(overrides))
        # The gradients are summed over the dp x cp ranks that replicate them, nothing over dp alone.
        assert "dp_cp" in s["comm"]["by_group"] and "dp" not in s["comm"]["by_group"]
    if tp > 1:
        check_tp_recompute(s, world, tp, recompute, m)
    if pp > 1:  # a stage boundary carries this rank's b·(s/cp)·h
        sends = s["comm"]["by_tag_op"]["pp/fwd/0->1"]["send"]
        assert sends["payload_bytes"] == sends["calls"] * (GLOBAL_BATCH // m) * (S // cp) * H * 4
    memory = s["memory"]
    if memory["formula"] is not None:  # the model state per rank: cp, cp_a2a and one-stage 3d have it
        assert memory["matches_formula"] is True
    if cp == 1 or pp == 1:  # the registry's activation formula: measured on every rank, to the byte
        assert memory["theory"]["activation_bytes"] is not None
        assert memory["activations_bytes_measured"] == memory["theory"]["activation_bytes"]
        assert memory["activations_match_theory"] is True


def test_a_layout_cp_cannot_cut_is_refused_in_one_line_before_any_group(tmp_path):
    """Under torchrun too: exit 2 and the one line, no summary (in-process checks of every rule
    are in tests/unit/test_recompute.py)."""
    run = run_train(2, [*TINY, "parallel=cp_a2a", "model.n_heads=1", "model.d_model=64"], tmp_path / "run", timeout=90)
    assert run.returncode != 0
    assert ("error: parallel.cp=2 does not divide the 1 attention heads per rank: the all-to-all gives each rank "
            "heads/cp whole heads; use cp in [1], or the ring (parallel=cp)") in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()
