"""ParallelDims and the run plan: every bad layout is refused before any process group."""

import pytest
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT
from options import option

import parallel.dist.dims as dims_module
from parallel.dist.binding import threads_per_rank
from parallel.dist.dims import DIMS, MESH_DIMS, SIZES, LayoutError, ParallelDims, shared_coordinates
from parallel.dist.groups import LaunchEnv, choose_backend
from parallel.run_plan import ConfigError, build_plan


def plan_for(world: int, *overrides: str):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return build_plan(cfg, LaunchEnv(rank=0, world_size=world, local_world_size=world), cuda_available=False)


def test_dp_defaults_to_what_the_world_leaves():
    assert ParallelDims.resolve(8, tp=2, pp=2).dp == 2
    assert ParallelDims.resolve(4).dp == 4


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (1, 2, 2), (4, 1, 2), (2, 4, 1)])
def test_rank_order_is_tp_innermost_then_dp_then_pp(dp, tp, pp):
    dims = ParallelDims.resolve(dp * tp * pp, dp=dp, tp=tp, pp=pp)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coordinates(rank)
        assert rank == (c["pp"] * dp + c["dp"]) * tp + c["tp"] == dims.rank_of(c["pp"], c["dp"], c["tp"])
        seen.add((c["pp"], c["dp"], c["tp"]))
    assert len(seen) == dims.world_size


@pytest.mark.parametrize("dp,cp,tp,pp", [(2, 2, 2, 1), (1, 4, 1, 2), (2, 2, 1, 2)])
def test_cp_sits_between_tp_and_dp(dp, cp, tp, pp):
    dims = ParallelDims.resolve(dp * cp * tp * pp, dp=dp, tp=tp, pp=pp, cp=cp)
    for rank in range(dims.world_size):
        c = dims.coordinates(rank)
        assert rank == ((c["pp"] * dp + c["dp"]) * cp + c["cp"]) * tp + c["tp"] \
            == dims.rank_of(c["pp"], c["dp"], c["tp"], c["cp"])
    # Every group of a dimension differs only in that coordinate; together they cover the world once.
    for name in ("pp", "dp", "cp", "tp", "dp_cp"):
        groups = dims.group_ranks(name)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))


def test_the_dimensions_are_declared_once():
    """One row per dimension in DIMS, and the module docstring's table shows every row; the mesh's
    rows innermost first are its rank order; every size is a ParallelDims field and back."""
    doc = dims_module.__doc__
    table = doc[doc.index("    name   mesh"):].split("\n\n")[0].splitlines()[1:]
    assert [line.split()[0] for line in table if not line.startswith("     ")] == [d.name for d in DIMS]
    assert MESH_DIMS == ("pp", "dp", "cp", "tp") and SIZES == ("dp", "tp", "pp", "cp", "ep", "dp_shard")
    dims = ParallelDims.resolve(16, dp=4, tp=2, cp=2, ep=2)
    assert dims.mesh_shape == (1, 4, 2, 2) and dims.groups_in_use() == ("ep", "edp", "dp_cp")
    for d in DIMS:  # every group of every row: the ranks that share its coordinates, covering the world once
        groups = dims.group_ranks(d.name)
        assert sorted(r for g in groups for r in g) == list(range(16)), d.name
        for g in groups:
            assert len({tuple(dims.coordinates(r)[k] for k in shared_coordinates(d.name)) for r in g}) == 1


def test_ep_is_carved_out_of_dp():
    dims = ParallelDims.resolve(8, dp=8, ep=4)
    assert dims.group_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(LayoutError, match=r"parallel.ep=3 does not divide parallel.dp=8"):
        ParallelDims.resolve(8, ep=3)


def test_hsdp_shard_groups_are_carved_out_of_dp():
    """dp_shard consecutive dp ranks shard (inside a node where ranks are placed node by node); the ranks
    with the same shard index replicate it; a dp_shard that does not divide dp is refused by value."""
    dims = ParallelDims.resolve(8, dp=8, dp_shard=4)
    assert dims.groups_in_use() == ("dp_shard", "dp_replicate")
    assert dims.group_ranks("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_ranks("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ParallelDims.resolve(8).groups_in_use() == ()
    with pytest.raises(LayoutError, match=r"parallel.dp_shard=3 does not divide parallel.dp=8: .*dp_shard=2\)"):
        ParallelDims.resolve(8, dp_shard=3)
    with pytest.raises(LayoutError, match=r"parallel.dp_shard=0 must be a positive integer"):
        ParallelDims.resolve(8, dp_shard=0)


def test_world_size_must_equal_the_product():
    with pytest.raises(LayoutError, match=r"world size 4 != parallel.dp x parallel.tp x parallel.pp = 3 x 1 x 1 = 3"):
        ParallelDims.resolve(4, dp=3)
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by parallel.tp x parallel.pp = 4 x 1 = 4"):
        ParallelDims.resolve(6, tp=4)


def test_batch_must_divide_into_dp_and_microbatches():
    with pytest.raises(LayoutError,
                       match=r"train.global_batch=10 is not divisible by "
                             r"parallel.dp x parallel.microbatches = 2 x 4 = 8"):
        ParallelDims.resolve(2).check_batch(10, 4)


def test_plan_defaults_single_process_dp_is_single():
    plan = plan_for(1)
    assert plan.strategy == "single" and plan.backend is None and plan.dims.dp == 1


def test_plan_dp_under_torchrun():
    plan = plan_for(4, "parallel=dp_naive", "parallel.microbatches=2")
    assert (plan.strategy, option(plan, "grad_sync"), plan.dims.dp, plan.backend) == ("dp", "naive", 4, "gloo")
    assert plan.local_batch == 4 and plan.layout.microbatch_size == 2


@pytest.mark.parametrize("world,overrides,message", [
    (2, ["parallel=single"], r"parallel=single runs one process but the world size is 2"),
    (1, ["parallel=torch_ddp"], r"parallel=torch_ddp needs at least 2 processes"),
    (2, ["parallel.tp=2"], r"parallel=dp is data parallel only, but parallel.tp=2"),
    (2, ["train.global_batch=7"],
     r"train.global_batch=7 is not divisible by parallel.dp x parallel.microbatches = 2 x 1 = 2"),
    (2, ["parallel.grad_sync=ring"], r"parallel.grad_sync='ring'"),
    (2, ["parallel.backend=nccl"], r"parallel.backend=nccl needs CUDA GPUs and none is visible"),
    (2, ["parallel.backend=mpi"], r"parallel.backend='mpi' is not one of auto, gloo, nccl"),
    (2, ["parallel.name=zero9"], r"parallel.name='zero9' is not a strategy"),
    (1, ["train.warmup_steps=20"], r"train.warmup_steps=20 must be at least 0 and below train.steps=20"),
    (1, ["model.n_heads=3"], r"model.d_model=256 is not divisible by model.n_heads=3"),
    (2, ["parallel.timeout_s=0"], r"parallel.timeout_s=0 must be a positive number"),
    (1, ["train.precision=fp16"], r"train.precision='fp16' is not one of fp32, bf16"),
    (3, ["parallel=pp_1f1b", "model=tiny", "train.global_batch=12"],
     r"model.n_layers=4 does not split evenly into parallel.pp x parallel.virtual_stages = 3 pieces"),
    (2, ["parallel=pp_interleaved", "model=tiny", "parallel.microbatches=3", "train.global_batch=12"],
     r"parallel.microbatches=3 is not a multiple of parallel.pp=2, which the interleaved schedule needs"),
    (2, ["parallel=pp_1f1b", "parallel.virtual_stages=2"], r"1f1b runs one chunk per rank; use pp_interleaved"),
    (2, ["parallel=pp_1f1b", "model=tiny", "parallel.pp_layers=[3,2]"],
     r"parallel.pp_layers=\[3, 2\] must list 2 positive layer counts .* summing to model.n_layers=4"),
    (2, ["parallel=pp_1f1b", "parallel.schedule=zb"], r"parallel.schedule='zb' is not a schedule"),
    # One plain process runs a pipeline preset as `single`, but still refuses a schedule it does not know.
    (1, ["parallel=pp_1f1b", "parallel.schedule=foo"], r"parallel.schedule='foo' is not a schedule"),
    (2, ["parallel=pp_interleaved", "parallel.dp=2"],
     r"parallel.virtual_stages=2 interleaves chunks across pipeline ranks, but parallel.pp=1"),
    (4, ["parallel=pp_1f1b", "parallel.dp=3"],
     r"world size 4 is not divisible by parallel.dp x parallel.tp = 3 x 1 = 3"),
    (3, ["parallel.dp=2"], r"world size 3 != parallel.dp x parallel.tp x parallel.pp = 2 x 1 x 1 = 2"),
    # Tensor parallelism: the model must split evenly over tp, checked before any process group.
    (3, ["parallel=tp", "parallel.tp=3"],
     r"model.n_heads=8 is not divisible by parallel.tp=3: use a tp that divides the head count \(1, 2, 4 or 8\)"),
    (2, ["parallel=tp", "model.vocab_size=257", "model.vocab_pad_multiple=1"],
     r"the padded vocabulary 257 \(model.vocab_size=257 rounded up to a multiple of model.vocab_pad_multiple=1\) "
     r"is not divisible by parallel.tp=2: pad to a multiple of tp, e.g. model.vocab_pad_multiple=2"),
    (2, ["parallel=tp_sp", "model.seq_len=33"],
     r"model.seq_len=33 is not divisible by parallel.tp=2, and sequence parallelism"),
    (2, ["parallel=tp", "model.dropout=0.1"], r"model.dropout=0.1 with parallel.tp=2: .* set model.dropout=0"),
    # Llama's block: whole K/V heads per rank (kv/tp, or one on tp/kv ranks), and an MLP width tp divides.
    (2, ["parallel=tp", "model=tiny_llama", "model.n_heads=6", "model.d_model=96", "model.n_kv_heads=3"],
     r"parallel.tp=2 neither divides nor is a multiple of model.n_kv_heads=3: .* use parallel.tp in 1, 3, 6"),
    (4, ["parallel=tp", "parallel.tp=4", "model=tiny_llama", "model.ffn_hidden=190"],
     r"model.ffn_hidden=190 is not divisible by parallel.tp=4: .* set model.ffn_hidden to a multiple of 4"),
    (2, ["parallel.sequence_parallel=true"],
     r"parallel.sequence_parallel=true needs tensor parallelism, but parallel=dp"),
    (1, ["parallel=tp"], r"world size 1 is not divisible by parallel.tp x parallel.pp = 2 x 1 = 2"),
    (3, ["parallel=tp"], r"world size 3 is not divisible by parallel.tp x parallel.pp = 2 x 1 = 2"),
    # PyTorch's baselines: refused by name before any process group, as ours are.
    (1, ["parallel=accelerate_ddp"], r"parallel=accelerate_ddp needs at least 2 processes"),
    (4, ["parallel=torch_pp_1f1b", "parallel.dp=2"],
     r"parallel=torch_pp runs one torch.distributed.pipelining pipeline .* parallel.dp=2"),
    (2, ["parallel=torch_tp", "parallel.tp=1"], r"parallel=torch_tp needs parallel.tp >= 2 \(got 1\)"),
    (4, ["parallel=torch_tp", "parallel.tp=4", "model=tiny_llama"],
     r"parallel=torch_tp with parallel.tp=4 and model.n_kv_heads=2: .* tp must divide them"),
    (2, ["parallel=torch_tp", "parallel.sequence_parallel=true"],
     r"parallel.sequence_parallel=true needs tensor parallelism, but parallel=torch_tp"),
    (3, ["parallel=torch_pp_1f1b", "model=tiny", "train.global_batch=12"],
     r"model.n_layers=4 does not split evenly into parallel.pp x parallel.virtual_stages = 3 pieces"),
    (2, ["train.peak_flops=-1"], r"train.peak_flops=-1 must be a positive number"),
])
def test_plan_refuses_bad_config(world, overrides, message):
    with pytest.raises((LayoutError, ConfigError), match=message):
        plan_for(world, *overrides)


def test_plan_tp_leaves_dp_to_the_world():
    plan = plan_for(4, "parallel=tp")
    assert (plan.strategy, plan.dims.dp, plan.dims.tp, option(plan, "sequence_parallel")) == ("tp", 2, 2, False)
    plan = plan_for(4, "parallel=tp_sp", "parallel.tp=4", "model=tiny")
    assert (plan.strategy, plan.dims.dp, plan.dims.tp, option(plan, "sequence_parallel")) == ("tp", 1, 4, True)
    assert option(plan_for(2, "parallel=dp"), "sequence_parallel") is False


def test_tp_over_one_rank_is_data_parallel():
    plan = plan_for(2, "parallel=tp_sp", "parallel.tp=1")
    assert (plan.strategy, plan.dims.dp, option(plan, "sequence_parallel")) == ("dp", 2, False)


def test_backend_choice():
    assert choose_backend("auto", cuda_available=False) == "gloo"
    assert choose_backend("auto", cuda_available=True) == "nccl"
    assert choose_backend("gloo", cuda_available=True) == "gloo"


def test_threads_share_the_cores():
    assert threads_per_rank(local_world_size=10_000) == 1
    assert threads_per_rank(local_world_size=1, requested=3) == 3


def test_giving_pp_on_a_pipeline_preset_derives_dp():
    """A user who sets pp expects dp to be what the world leaves (the preset fixes neither)."""
    plan = plan_for(4, "parallel=pp_1f1b", "parallel.pp=2", "model=tiny")
    assert (plan.strategy, plan.dims.dp, plan.dims.pp) == ("pp", 2, 2)


def test_plan_pipeline_derives_pp_from_the_world():
    plan = plan_for(4, "parallel=pp_1f1b", "model=tiny")
    assert (plan.strategy, plan.dims.pp, plan.dims.dp, option(plan, "schedule")) == ("pp", 4, 1, "1f1b")
    plan = plan_for(4, "parallel=pp_interleaved", "parallel.dp=2", "model=tiny")
    assert (plan.dims.pp, plan.dims.dp, option(plan, "virtual_stages")) == (2, 2, 2)
    assert option(plan_for(2, "parallel=pp_gpipe", "model=tiny", "parallel.pp_layers=[1,3]"), "pp_layers") == (1, 3)


# -- dp x tp x pp on one mesh ----------------------------------------------------------------------
@pytest.mark.parametrize("world,overrides,layout", [
    (8, ["parallel=3d"], (2, 2, 2)),                  # the preset's defaults: dp derived from the world
    (4, ["parallel=3d"], (1, 2, 2)),
    (4, ["parallel=3d", "parallel.pp=1"], (2, 2, 1)),
    (4, ["parallel=pp_1f1b", "parallel.tp=2"], (1, 2, 2)),  # pp derived: 4 / (dp 1 x tp 2)
    (4, ["parallel=tp", "parallel.pp=2"], (1, 2, 2)),       # dp derived: 4 / (tp 2 x pp 2)
    (8, ["parallel=tp_sp", "parallel.pp=2"], (2, 2, 2)),
])
def test_pipeline_of_tensor_parallel_stages_is_3d(world, overrides, layout):
    plan = plan_for(world, "model=tiny", *overrides)
    assert plan.strategy == "3d" and (plan.dims.dp, plan.dims.tp, plan.dims.pp) == layout
    assert option(plan, "sequence_parallel") == ("parallel=tp_sp" in overrides)


def test_3d_with_one_rank_of_everything_is_single():
    assert plan_for(1, "parallel=3d", "parallel.tp=1", "parallel.pp=1").strategy == "single"


@pytest.mark.parametrize("world,overrides,message", [
    (6, ["parallel=3d"], r"world size 6 is not divisible by parallel.tp x parallel.pp = 2 x 2 = 4"),
    (8, ["parallel=3d", "parallel.dp=4"], r"world size 8 != parallel.dp x parallel.tp x parallel.pp = 4 x 2 x 2 = 16"),
    (8, ["parallel=3d", "parallel.tp=8", "parallel.pp=1"], r"model.n_heads=4 is not divisible by parallel.tp=8"),
    (4, ["parallel=3d", "model.vocab_size=257", "model.vocab_pad_multiple=1"],
     r"the padded vocabulary 257 .* is not divisible by parallel.tp=2"),
    (8, ["parallel=3d", "parallel.tp=1", "parallel.pp=8"],
     r"model.n_layers=4 does not split evenly into parallel.pp x parallel.virtual_stages = 8 pieces"),
    (8, ["parallel=3d", "train.global_batch=12"],
     r"train.global_batch=12 is not divisible by parallel.dp x parallel.microbatches = 2 x 4 = 8"),
    (4, ["parallel=3d", "parallel.sequence_parallel=true", "model.seq_len=33"],
     r"model.seq_len=33 is not divisible by parallel.tp=2, and sequence parallelism"),
    (4, ["parallel=3d", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "parallel.microbatches=3",
         "train.global_batch=12"], r"parallel.microbatches=3 is not a multiple of parallel.pp=2"),
    (4, ["parallel=3d", "parallel.tp=1", "parallel.pp=4", "parallel.sequence_parallel=true"],
     r"parallel.sequence_parallel=true needs tensor parallelism, but parallel=3d with parallel.tp=1"),
    (4, ["parallel=3d", "model.dropout=0.1"], r"model.dropout=0.1 with parallel.tp=2"),
])
def test_3d_refuses_what_does_not_divide(world, overrides, message):
    with pytest.raises((LayoutError, ConfigError), match=message):
        plan_for(world, "model=tiny", *overrides)


# -- the dp dimension as ZeRO-1/2 (parallel.zero) ----------------------------------------------------
@pytest.mark.parametrize("world,overrides,strategy,layout,zero", [
    (8, ["parallel=3d", "parallel.zero=1"], "3d", (2, 2, 2), 1),
    (4, ["parallel=3d", "parallel.pp=1", "parallel.zero=2"], "3d", (2, 2, 1), 2),
    (4, ["parallel=tp", "parallel.zero=1"], "3d", (2, 2, 1), 1),                 # tp with ZeRO dp: the 3d path
    (4, ["parallel=pp_1f1b", "parallel.dp=2", "parallel.zero=2"], "3d", (2, 1, 2), 2),  # pp with ZeRO dp too
    (8, ["parallel=pp_interleaved", "parallel.dp=2", "parallel.tp=2", "parallel.zero=1"], "3d", (2, 2, 2), 1),
    (8, ["parallel=tp_sp", "parallel.pp=2", "parallel.zero=1"], "3d", (2, 2, 2), 1),
    (4, ["parallel=dp", "parallel.zero=2"], "zero2", (4, 1, 1), 0),               # pure dp: the zero<k> strategy
    (2, ["parallel=dp", "parallel.zero=3"], "zero3", (2, 1, 1), 0),
    (8, ["parallel=3d"], "3d", (2, 2, 2), 0),
])
def test_zero_is_the_dp_dimension_of_any_layout(world, overrides, strategy, layout, zero):
    plan = plan_for(world, "model=tiny", *overrides)
    assert (plan.strategy, (plan.dims.dp, plan.dims.tp, plan.dims.pp), option(plan, "zero")) == (strategy, layout, zero)


@pytest.mark.parametrize("world,overrides,message", [
    (4, ["parallel=3d", "parallel.zero=4"],
     r"parallel.zero=4 is not a ZeRO stage: choose 0 \(plain dp all-reduce\), 1 or 2"),
    (4, ["parallel=3d", "parallel.zero=1"],
     r"parallel.zero=1 shards over the data-parallel ranks, but parallel.dp=1 \(world 4 = dp 1 x tp 2 x pp 2\)"),
    (1, ["parallel=dp", "parallel.zero=1"], r"parallel.zero=1 shards over the data-parallel ranks, but parallel.dp=1"),
    (4, ["parallel=zero1", "parallel.zero=2"],
     r"parallel.zero=2 sets the ZeRO stage .* but parallel=zero1 is a ZeRO stage already"),
    (4, ["parallel=torch_ddp", "parallel.zero=1"], r"parallel=torch_ddp has no such dp sync: set parallel.zero=0"),
    (8, ["parallel=3d", "parallel.zero=3"],
     r"parallel.zero=3 does not compose with parallel.tp=2 parallel.pp=2 here: "
     r"ZeRO-3 all-gathers each part's parameters"),
    (4, ["parallel=tp", "parallel.zero=3"], r"parallel.zero=3 does not compose with parallel.tp=2 parallel.pp=1"),
])
def test_zero_dp_dimension_refusals(world, overrides, message):
    with pytest.raises((LayoutError, ConfigError), match=message):
        plan_for(world, "model=tiny", *overrides)


# -- a head tied to the token table (model.tied_head): trained where the strategy keeps whole parameters --
TIED = ["model=tiny_llama", "model.tied_head=true"]


@pytest.mark.parametrize("world,overrides,strategy", [
    (1, ["parallel=single"], "single"), (2, ["parallel=dp"], "dp"), (2, ["parallel=dp_naive"], "dp"),
    (2, ["parallel=dp", "parallel.zero=1"], "zero1"), (2, ["parallel=zero2"], "zero2"),
    (2, ["parallel=torch_ddp"], "torch_ddp"), (2, ["parallel=accelerate_ddp"], "accelerate_ddp"),
    (2, ["parallel=torch_zero1"], "torch_zero1"), (2, ["parallel=torch_zero2"], "torch_zero2"),
    (2, ["parallel=torch_fsdp2"], "torch_fsdp2"), (2, ["parallel=tp"], "tp"),
    (4, ["parallel=tp_sp", "parallel.tp=4"], "tp"),
    (2, ["parallel=cp"], "cp"), (2, ["parallel=cp_a2a"], "cp_a2a"),
    # A pipeline preset in one process is the single run: nothing is cut.
    (1, ["parallel=pp_1f1b"], "single"),
])
def test_a_tied_head_runs_where_parameters_stay_whole(world, overrides, strategy):
    assert plan_for(world, *TIED, *overrides).strategy == strategy


@pytest.mark.parametrize("world,overrides,strategy,why", [
    (2, ["parallel=zero3"], "zero3", r"zero3 gathers each part's flat buffer .* freed weight"),
    (2, ["parallel=pp_1f1b"], "pp", r"the embedding and the head sit on different stages"),
    (2, ["parallel=pp_zbv", "parallel.microbatches=4"], "pp", r"different stages"),
    (2, ["parallel=torch_pp_gpipe"], "torch_pp", r"torch.distributed.pipelining puts the embedding and the head"),
    (8, ["parallel=3d"], "3d", r"the recipe's pipeline stages hold one part each: the embedding and the head"),
    (2, ["parallel=torch_tp"], "torch_tp", r"its plan distributes the token table and the head as two modules"),
])
def test_a_tied_head_is_refused_in_one_line_where_the_model_is_cut(world, overrides, strategy, why):
    """Before any process group, in one line: the strategy, the field, the entry's reason, the fix."""
    message = (rf"^parallel={strategy} does not train a head tied to the token table \(model.tied_head=true\): .*"
               rf"{why}.*; use one of single, dp, zero1, zero2, hsdp_zero2, tp, torch_ddp, accelerate_ddp, "
               rf"torch_fsdp2, torch_hsdp, torch_zero1, torch_zero2, ep, cp, cp_a2a, or an untied head "
               rf"\(model.tied_head=false\)$")
    with pytest.raises(ConfigError, match=message):
        plan_for(world, *TIED, *overrides)
