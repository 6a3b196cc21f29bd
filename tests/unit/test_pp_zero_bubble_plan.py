"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) in the rest of the system: the refusals run_plan.py
gives before any process group, the 3d closed forms on the V against the chunks the model is cut
into, and the comparison's pairing of each schedule with PyTorch's. No processes.
"""

from collections import Counter
from fractions import Fraction as Fr

import pytest

from parallel.core.model import GPTConfig
from parallel.pp.schedules import schedule_placement


def plan_error(world: int, *overrides: str) -> str:
    """The one-line refusal run_plan.py gives before any process group (empty if it accepts)."""
    from hydra import compose, initialize_config_dir
    from launcher import PROJECT_ROOT

    from parallel.dist.dims import LayoutError
    from parallel.dist.groups import LaunchEnv
    from parallel.run_plan import ConfigError, build_plan

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", *overrides])
    try:
        build_plan(cfg, LaunchEnv(rank=0, world_size=world, local_world_size=world), cuda_available=False)
    except (ConfigError, LayoutError) as e:
        return str(e)
    return ""


@pytest.mark.parametrize("world,overrides,message", [
    (4, ["parallel=pp_dualpipev", "model.n_layers=8", "parallel.microbatches=4"],
     "dualpipev needs at least 2 x parallel.pp = 8 microbatches"),
    (2, ["parallel=pp_zbv", "parallel.virtual_stages=1"], "zbv runs exactly two chunks per rank in a V"),
    (2, ["parallel=torch_pp_interleaved_zb", "parallel.microbatches=5", "train.global_batch=10"],
     "ScheduleInterleavedZeroBubble runs microbatches in 2 rounds (m // parallel.pp) and needs m to be a multiple "
     "of that: use parallel.microbatches=4"),
    (2, ["parallel=torch_pp_dualpipev", "parallel.microbatches=2"], "dualpipev needs at least 2 x parallel.pp = 4"),
])
def test_plan_refuses_what_a_schedule_cannot_run(world, overrides, message):
    error = plan_error(world, *overrides)
    assert message in error and "\n" not in error, error


@pytest.mark.parametrize("world,overrides", [
    (4, ["parallel=pp_zbh1", "parallel.dp=2", "parallel.grad_sync=bucketed", "parallel.microbatches=2"]),
    (4, ["parallel=pp_zbv", "parallel.dp=2", "parallel.grad_sync=bucketed"]),
    (4, ["parallel=pp_zbh1", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"]),
    (4, ["parallel=pp_dualpipev", "parallel.dp=2", "parallel.zero=1", "parallel.microbatches=4"]),
    (2, ["parallel=torch_pp_interleaved_zb", "parallel.microbatches=6", "train.global_batch=12"]),
])
def test_plan_accepts_what_composes_with_w(world, overrides):
    """W accumulates each weight's gradient once per microbatch, so the bucketed sync (which counts each
    parameter's last one down, whichever chunk's backward brings it) and ZeRO-2 (each part's, each
    microbatch) compose with it; ZeRO-1 reduces after the schedule, whatever it is."""
    assert plan_error(world, *overrides) == ""


# -- the closed forms on the V: what each rank holds and sends, counted on the model itself ------------------

@pytest.mark.parametrize("d,t,p,m,sp,zero", [(1, 2, 2, 4, True, 0), (2, 1, 2, 4, False, 0), (1, 1, 4, 8, False, 0),
                                           (2, 1, 2, 4, False, 1)])
def test_3d_theory_on_the_v_written_out(d, t, p, m, sp, zero):
    """Under the V rank 0 holds the embedding and the head (stages 0 and 2p-1): theory's per-rank
    parameters, tp bytes and pp sends, against the chunks split_model gives each rank."""
    from types import SimpleNamespace

    from parallel.compose.theory import combined_local_parameter_count, stage_ends, stage_layers
    from parallel.core.model import GPT, part_of
    from parallel.dist.dims import ParallelDims
    from parallel.pp.split import split_model
    from parallel.pp.theory import p2p_sent_by_rank
    from parallel.registry import expected_comm
    from parallel.tp.layers import parallelize_tp

    cfg = GPTConfig(seq_len=32, n_layers=8, d_model=64, n_heads=4)
    S, H, b = cfg.seq_len, cfg.d_model, 2
    dims = ParallelDims.resolve(d * t * p, dp=d, tp=t, pp=p)
    place = schedule_placement("zbv", p, 2)
    fig = expected_comm("3d", cfg, dims, microbatch_size=b, microbatches=m, virtual=2, sequence_parallel=sp,
                        schedule="zbv", zero=zero)
    ends, layers = stage_ends(dims, 2, "zbv"), stage_layers(cfg, dims, 2, schedule="zbv")
    assert ends[0] == (True, True) and all(e == (False, False) for e in ends[1:])
    boundary = b * (S // t if sp else S) * H * 4
    pp_sent = p2p_sent_by_rank("zbv", p, m, 2, boundary)
    q = Fr(t - 1, t)
    for r in range(p):
        model = GPT(cfg, seed=0)
        parallelize_tp(model, SimpleNamespace(rank=0, size=t))
        chunks = split_model(model, p, 2, r, placement=place)
        assert [c.vstage for c in chunks] == [r, 2 * p - 1 - r]
        first, last = chunks[0].embed is not None, chunks[1].head is not None
        assert (first, last) == ends[r] and sum(len(c.blocks) for c in chunks) == layers[r]
        held = sum(x.numel() for c in chunks for x in c.parameters())
        assert held == combined_local_parameter_count(cfg, dims, 2, pp_rank=r, schedule="zbv")
        acts = (4 * layers[r] + first + last) * m * b * S * H * 4
        loss = 3 * m * b * S * 4 if last else 0
        sp_grads = (6 * H * layers[r] + S * H * first + 2 * H * last) * 4 if sp else 0
        tp_bytes = 2 * q * (acts + loss + sp_grads)
        if zero:  # ZeRO-1: the parts (embedding, each block, head) padded to multiples of d, one
            parts = Counter()  # reduce-scatter of the gradients and one all-gather of the parameters
            for c in chunks:
                for n, x in c.named_parameters():
                    parts[part_of(c.global_name(n))] += x.numel()
            dp_bytes = Fr(d - 1, d) * 2 * 4 * sum(-(-n // d) * d for n in parts.values())
        else:
            dp_bytes = 2 * Fr(d - 1, d) * held * 4
        assert Fr(fig["sent_bytes_per_rank_by_stage_exact"][r]) == tp_bytes + pp_sent[r] + dp_bytes, r
    assert Fr(fig["by_group"]["pp"]["sent_bytes_exact"]) == 2 * m * 2 * (p - 1) * boundary * d * t


def test_the_comparison_pairs_each_zero_bubble_schedule_with_pytorchs():
    """pp's counterpart is torch_pp, matched by schedule: pp_zbh1 with torch_pp_interleaved_zb (its
    schedule is zbh1), pp_zbv with torch_pp_zbv, pp_dualpipev with torch_pp_dualpipev."""
    from launcher import PROJECT_ROOT
    from omegaconf import OmegaConf

    from parallel.compare.rows import add_baseline_ratios

    def schedule_of(preset):
        cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "parallel" / f"{preset}.yaml")
        while "schedule" not in cfg:
            cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "parallel" / f"{cfg.defaults[0]}.yaml")
        return cfg.schedule

    presets = ["pp_1f1b", "pp_zbh1", "pp_zbv", "pp_dualpipev", "torch_pp_1f1b", "torch_pp_interleaved_zb",
               "torch_pp_zbv", "torch_pp_dualpipev"]
    rows = [{"strategy": p, "runs_as": "torch_pp" if p.startswith("torch") else "pp", "schedule": schedule_of(p),
             "status": "ok", "tokens_per_s": 100.0 + i, "baseline": None, "ratio_to_baseline": None}
            for i, p in enumerate(presets)]
    add_baseline_ratios(rows)
    assert {r["strategy"]: r["baseline"] for r in rows if r["runs_as"] == "pp"} == {
        "pp_1f1b": "torch_pp_1f1b", "pp_zbh1": "torch_pp_interleaved_zb", "pp_zbv": "torch_pp_zbv",
        "pp_dualpipev": "torch_pp_dualpipev"}
    assert rows[2]["ratio_to_baseline"] == 102.0 / 106.0
