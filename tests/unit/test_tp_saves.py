"""parallel.tp_saves: what sequence-parallel tp's column-parallel linears keep for their weight gradient.

In one process, no ranks: the closed forms written out a second time (docs/theory/tensor-parallel.md,
docs/theory/memory.md) and the plan's refusals. The runs that check the mode against the single
process, the traffic log and the saved-tensor meter are in tests/runs/test_tp.py and
tests/tools/test_planner_memory.py.

  gathered  the all-gathered input b·s·h per region, as before
  sharded   this rank's piece b·(s/t)·h, all-gathered once more in backward (`tp/<part>/regather`):
            per microbatch 2L + 1 more all-gathers of b·s·h (attention and MLP in every block, the
            head), and (2L + 1)·b·s·h·(t-1)/t elements fewer saved for backward
"""

from dataclasses import replace
from fractions import Fraction

import pytest
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT
from options import option

from parallel import activations
from parallel.core.model import GPTConfig
from parallel.core.shape import ModelShape
from parallel.dist.dims import LayoutError, ParallelDims
from parallel.dist.groups import LaunchEnv
from parallel.planner.memory import block_units
from parallel.registry import expected_comm, layout_of
from parallel.run_plan import build_plan
from parallel.tp.options import TPOptions

CFG = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)
S, H, L = 32, 64, 4


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("b,m", [(1, 1), (4, 2)])
def test_sharded_saving_adds_one_all_gather_per_region_in_backward(t, b, m):
    dims = ParallelDims.resolve(t, tp=t)
    figs = {saves: expected_comm("tp", CFG, dims, microbatch_size=b, microbatches=m, sequence_parallel=True,
                                 tp_saves=saves) for saves in ("gathered", "sharded")}
    gathered, sharded = figs["gathered"]["by_op"], figs["sharded"]["by_op"]
    regathered = (2 * L + 1) * m * b * S * H * 4  # payload of one step's regathers on one rank
    assert sharded["all_gather"]["payload_bytes"] - gathered["all_gather"]["payload_bytes"] == regathered * t
    assert Fraction(sharded["all_gather"]["sent_bytes_exact"]) - Fraction(gathered["all_gather"]["sent_bytes_exact"]) \
        == Fraction(t - 1, t) * regathered * t
    for op in ("reduce_scatter", "all_reduce"):  # nothing else changes
        assert sharded[op] == gathered[op], op
    total, tp_group = ({saves: Fraction(fig[key] if key else fig["by_group"]["tp"]["sent_bytes_exact"])
                        for saves, fig in figs.items()} for key in ("sent_bytes_per_step_exact", None))
    assert total["sharded"] - total["gathered"] == Fraction(t - 1, t) * regathered * t  # all of it over tp
    assert tp_group["sharded"] - tp_group["gathered"] == Fraction(t - 1, t) * regathered * t
    assert figs["sharded"]["per_layer_per_microbatch"]["regather"] == {"all_gather": 2}
    assert "regather" not in figs["gathered"]["per_layer_per_microbatch"]


def test_without_sequence_parallelism_or_tp_nothing_is_regathered():
    """The theory of a layout the plan refuses is not asked for; the Layout alone still says nothing changes."""
    dims = ParallelDims.resolve(2, tp=2)
    plain = expected_comm("tp", CFG, dims, microbatch_size=2)
    assert expected_comm("tp", CFG, dims, microbatch_size=2, tp_saves="sharded") == plain


@pytest.mark.parametrize("t", [2, 4])
def test_sharded_saving_keeps_the_piece_of_every_column_parallel_input(t):
    b = 2
    n = b * S
    cuts = {saves: layout_of(ParallelDims.resolve(t, tp=t), microbatch_size=b, sequence_parallel=True,
                             tp_saves=saves).cut() for saves in ("gathered", "sharded")}
    terms = {saves: activations.block_terms(CFG, cut) for saves, cut in cuts.items()}
    for name in ("attention_input", "mlp_input"):
        assert terms["gathered"][name] == n * H * 4
        assert terms["sharded"][name] == n // t * H * 4
    for name in set(terms["gathered"]) - {"attention_input", "mlp_input"}:
        assert terms["sharded"][name] == terms["gathered"][name], name
    head = {saves: activations.head_saved_bytes(CFG, cut) for saves, cut in cuts.items()}
    assert head["gathered"] - head["sharded"] == (n - n // t) * H * 4
    # The whole rank, written out: 2L + 1 inputs of b·s·h elements each keep b·(s/t)·h.
    peaks = {saves: activations.registry_activations(CFG, layout_of(ParallelDims.resolve(t, tp=t), microbatch_size=b,
                                                                    sequence_parallel=True, tp_saves=saves))
             for saves in ("gathered", "sharded")}
    assert [g - s for g, s in zip(peaks["gathered"], peaks["sharded"])] == [(2 * L + 1) * (n - n // t) * H * 4] * t


def test_the_planners_implementation_units_take_the_same_term():
    """memory.block_units (cluster shapes, Megatron-style implementations): the QKV and MLP GEMMs'
    inputs are 2·w·h per token whole, or 2·w·h/t when the piece is saved; everything else is the same."""
    shape = ModelShape(gpt=CFG)
    for t in (2, 8):
        gathered = block_units(shape, t, True, 2)
        sharded = block_units(shape, t, True, 2, saves_shard=True)
        assert gathered["layer"] - sharded["layer"] == 2 * 2 * H * (1 - 1 / t)
        assert gathered["input"] == sharded["input"]
        # Korthikanti et al.'s sbh·34/t is the sharded one (34 = 32 + the two dropout masks, none here).
        assert sharded["layer"] == pytest.approx(32 * H / t)
        assert block_units(shape, t, False, 2, saves_shard=True) == block_units(shape, t, False, 2)


# -- the plan ----------------------------------------------------------------------------------------
def _plan(world: int, *overrides):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", *overrides])
    return build_plan(cfg, LaunchEnv(world_size=world, local_world_size=world), cuda_available=False)


def test_the_plan_carries_the_mode_into_the_layout():
    assert option(_plan(2, "parallel=tp_sp"), "tp_saves") == "gathered"
    plan = _plan(2, "parallel=tp_sp", "parallel.tp_saves=sharded")
    options = plan.layout.of(TPOptions)
    assert (options.saves, options.sequence_parallel, plan.layout.cut().saves_shard) == ("sharded", True, True)
    # The 3d recipe cuts its model with the same layers: a pipeline of tp stages takes it.
    plan = _plan(4, "parallel=3d", "parallel.sequence_parallel=true", "parallel.microbatches=2",
                 "parallel.tp_saves=sharded")
    assert (plan.strategy, plan.dims.pp, plan.dims.tp, option(plan, "tp_saves")) == ("3d", 2, 2, "sharded")


@pytest.mark.parametrize("world,overrides,message", [
    (2, ["parallel=tp_sp", "parallel.tp_saves=piece"],
     "parallel.tp_saves='piece' is not one of gathered, sharded: gathered keeps each column-parallel linear's "
     "all-gathered input for backward, sharded keeps this rank's piece of the sequence and gathers it again in "
     "backward"),
    (2, ["parallel=tp", "parallel.tp_saves=sharded"],
     "parallel.tp_saves=sharded with parallel.tp=2 and sequence parallelism off: the column-parallel linears keep "
     "their input's piece of the sequence, which only sequence parallelism over tp > 1 ranks cuts; use "
     "parallel=tp_sp with parallel.tp > 1, or set parallel.tp_saves=gathered"),
    (2, ["parallel=dp", "parallel.tp_saves=sharded"],
     "parallel.tp_saves=sharded with parallel.tp=1 and sequence parallelism off"),
])
def test_sharded_saving_without_a_piece_to_keep_is_refused_in_one_line(world, overrides, message):
    with pytest.raises(LayoutError) as refused:
        _plan(world, *overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_an_entry_with_other_tp_layers_is_refused():
    """Only tp and 3d take sequence parallelism today (the registry refuses it elsewhere first); an entry
    that took it with layers of its own would still be told its layers keep the gathered input."""
    from parallel.registry import REGISTRY, spec_of
    from parallel.tp.rules import check_tp_saves

    keepers = [name for name, spec in REGISTRY.items() if spec.honours_option(TPOptions, "saves")]
    with pytest.raises(LayoutError, match="runs as parallel=torch_tp, whose layers keep the gathered input: the "
                                          "sequence piece is kept by parallel=tp and 3d only"):
        check_tp_saves(TPOptions(True, "sharded"), spec_of("torch_tp"), keepers, ParallelDims.resolve(2, tp=2))


# -- the planner's one-layout mode ---------------------------------------------------------------------
def _one_layout(model: str, precision: str, world: int, parallel: dict) -> dict:
    import yaml
    from omegaconf import OmegaConf

    from parallel.planner.cluster import cluster_from_config
    from parallel.planner.one import evaluate_layout

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        base = OmegaConf.to_container(compose(config_name="config", overrides=[f"model={model}"]), resolve=True)
    shape = ModelShape.from_preset(yaml.safe_load((PROJECT_ROOT / "conf" / "model" / f"{model}.yaml").read_text()))
    spec = cluster_from_config(yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "h100_sxm.yaml").read_text()),
                               None, world)
    return shape, evaluate_layout(shape, base, [], replace(spec, precision=precision), world, 16,
                                  {**base["parallel"], **parallel})


@pytest.mark.parametrize("model,precision", [("tiny", "fp32"), ("llama3_8b", "bf16")])
def test_launch_plan_takes_parallel_tp_saves_with_the_same_term(model, precision):
    """`launch.plan ... parallel=tp_sp parallel.tp_saves=sharded`: the sandbox GPT in fp32 through the
    registry's formula (the one the runs are measured against), a cluster shape in bf16 through the
    implementation units; both lose the same (2L + 1 or L) column-parallel inputs' (t−1)/t, and the row
    says how to run it."""
    t, world = 4, 8
    rows = {saves: _one_layout(model, precision, world, {"name": "tp", "tp": t, "sequence_parallel": True,
                                                       "tp_saves": saves}) for saves in ("gathered", "sharded")}
    shape = rows["sharded"][0]
    g, (_, gathered), (_, sharded) = shape.gpt, rows["gathered"], rows["sharded"]
    tokens = 16 // (world // t) * g.seq_len  # one microbatch of a dp rank
    fp32 = precision == "fp32"
    width = 4 if fp32 else 2
    inputs = 2 * g.n_layers + 1 if fp32 else 2 * g.n_layers  # the implementation units leave out the head
    less = gathered["memory_bytes_per_device"]["activations"] - sharded["memory_bytes_per_device"]["activations"]
    assert less == pytest.approx(inputs * (tokens - tokens // t) * g.d_model * width, rel=1e-9)
    assert "parallel.tp_saves=sharded" in sharded["run_overrides"]
    assert not any(o.startswith("parallel.tp_saves") for o in gathered["run_overrides"])
    assert (gathered["layout"]["tp_saves"], sharded["layout"]["tp_saves"]) == ("gathered", "sharded")
