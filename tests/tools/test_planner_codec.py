"""The planner's codec term (parallel/planner/codec.py): the lossy collectives' casts, block scales and
error feedback, and DiLoCo's outer step, as elements x bytes per element / rate, part of compute.

Without training or timing: the bytes per step of each layout against the pass tables (which
tests/layers/test_codec_passes.py holds to the collectives' own operations), zero in fp32, in
proportion to the parameters, the microbatches (ZeRO-2/3 reduce every microbatch) and 1/H (DiLoCo);
the row's compute holding them at the cluster's rate; a GPU preset's rate its HBM's; and a PyTorch
baseline named in plan.layouts validated as a row of its own, while the search leaves baselines out.
"""

from __future__ import annotations

import pytest
import yaml
from launcher import PROJECT_ROOT
from test_planner import synthetic_cluster
from test_planner_remedies import _planned, base  # noqa: F401 (base: the fixture)

from parallel.core.shape import ModelShape
from parallel.planner import codec
from parallel.planner.cluster import cluster_from_config
from parallel.planner.enumerate import Space, enumerate_layouts
from parallel.planner.predict import predict_row
from parallel.planner.search import plan_rows


def _codec(base, model="tiny", world=4, **parallel):  # noqa: F811
    shape, plan, candidate, _ = _planned(base, model, world, world, name=parallel.pop("name", "dp"), **parallel)
    return shape, candidate, codec.codec_bytes(shape, plan.spec, plan.layout, candidate.zero)


def test_dp_codec_is_zero_in_fp32_and_the_formats_passes_over_every_parameter(base):  # noqa: F811
    """dp's one all-reduce per step: nothing in fp32, bf16's four passes (24 bytes per element), int8's
    block-scaled passes with error feedback, each over every parameter whatever the microbatches."""
    shape, _, fp32 = _codec(base, comm_dtype="fp32")
    assert fp32 == 0
    psi = shape.parameter_count()
    _, _, bf16 = _codec(base, comm_dtype="bf16", microbatches=2)
    assert codec.pass_count(codec.all_reduce_passes("bf16", 4, False)) == 4 and bf16 == 24 * psi
    _, _, int8 = _codec(base, comm_dtype="int8")
    assert int8 == pytest.approx(float(codec.bytes_per_element(codec.all_reduce_passes("int8", 4, True))) * psi)
    assert int8 > 10 * bf16
    # In proportion to the elements: Llama's block at the same size holds another count of parameters.
    llama, _, int8_llama = _codec(base, "tiny_llama", comm_dtype="int8")
    assert int8_llama / int8 == pytest.approx(llama.parameter_count() / psi)
    # PyTorch DDP's bf16 hook: three passes (no multiply back: its gradients are means).
    _, _, hook = _codec(base, name="torch_ddp", comm_dtype="bf16")
    assert hook == float(codec.bytes_per_element(codec.DDP_BF16_HOOK)) * psi == 16 * psi


def test_zero_reduces_every_microbatch_and_zero3_gathers_twice(base):  # noqa: F811
    """ZeRO-1 reduce-scatters once per step, ZeRO-2 once per microbatch, ZeRO-3 also all-gathers each
    part before its forward and its backward: the codec's bytes count each call."""
    scatter = float(codec.bytes_per_element(codec.reduce_scatter_passes("int8", 4)))
    gather = float(codec.bytes_per_element(codec.all_gather_passes("int8", 4)))
    shape, _, one = _codec(base, name="zero1", comm_dtype="int8", microbatches=2)
    _, _, two = _codec(base, name="zero2", comm_dtype="int8", microbatches=2)
    _, _, three = _codec(base, name="zero3", comm_dtype="int8", microbatches=2)
    psi = shape.parameter_count()
    assert one == pytest.approx(scatter * psi) and two == pytest.approx(2 * one)
    assert three == pytest.approx(2 * scatter * psi + 4 * gather * psi)


def test_diloco_outer_step_is_its_passes_once_per_h_steps(base):  # noqa: F811
    """The pseudo-gradient and the Nesterov step over every parameter, once per H steps; without momentum
    three passes fewer."""
    shape, _, h10 = _codec(base, name="diloco", inner_steps=10, outer_momentum=0.9)
    _, _, h50 = _codec(base, name="diloco", inner_steps=50, outer_momentum=0.9)
    _, _, plain = _codec(base, name="diloco", inner_steps=10, outer_momentum=0.0)
    assert h10 == pytest.approx(5 * h50)
    assert h10 == pytest.approx(float(codec.bytes_per_element(codec.outer_step_passes(True))) * shape.parameter_count()
                                / 10)
    assert len(codec.outer_step_passes(True)) - len(codec.outer_step_passes(False)) == 3 and plain < h10


def test_the_rows_compute_holds_the_codec_at_the_clusters_rate(base):  # noqa: F811
    """The same row at a codec rate of 1 GB/s and without one: compute and total differ by the codec's
    bytes over 1 GB/s, which the row names, and the optimizer step's at the same rate; the exposed
    communication does not move."""
    shape, candidate, nbytes = _codec(base, comm_dtype="int8")
    timed = predict_row(shape, candidate, synthetic_cluster(codec_bytes_per_s=1e9), "dp")["step_time_s"]
    bare = predict_row(shape, candidate, synthetic_cluster(), "dp")["step_time_s"]
    assert bare["codec"] == 0 and nbytes > 0 and timed["codec"] == pytest.approx(nbytes / 1e9)
    assert bare["optimizer"] == 0 and timed["optimizer"] > 0
    assert timed["compute"] - bare["compute"] == pytest.approx(timed["codec"] + timed["optimizer"])
    assert timed["total"] - bare["total"] == pytest.approx(timed["codec"] + timed["optimizer"])
    assert timed["exposed_comm"] == bare["exposed_comm"]


def test_a_gpu_presets_codec_rate_is_its_hbm():
    h100 = yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "h100_sxm.yaml").read_text())
    cluster = cluster_from_config(h100)
    assert cluster.codec_bytes_per_s == cluster.hbm_bytes_per_s == 3.35e12


def test_this_machines_codec_rate_is_probed_on_every_rank_at_once_and_a_given_one_is_kept():
    """Left null, the codec rate comes from the loopback probe's run with the planned world's ranks
    (one probe run for the three figures), a positive rate per rank; a given figure is taken as it is."""
    preset = {**yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "this_machine.yaml").read_text()),
              "peak_tflops": 0.3, "loopback_gbytes_per_s": 1.0, "loopback_latency_us": 100}
    probed = cluster_from_config(preset, None, world=2)
    assert probed.codec_bytes_per_s > 0 and probed.intra_bytes_per_s == 1e9  # the given loopback kept
    given = cluster_from_config({**preset, "codec_gbytes_per_s": 3.0}, None, world=2)
    assert given.codec_bytes_per_s == 3e9


def test_a_one_rank_plan_probes_its_codec_in_process_without_a_probe_run(monkeypatch):
    """A one-rank plan with the loopback figures given needs only its codec rate (its optimizer step):
    measured in the planner's own process, no gloo probe run started for it."""
    import parallel.planner.loopback as loopback

    monkeypatch.setattr(loopback, "measure", lambda *a, **k: pytest.fail("a probe run for a one-rank plan"))
    preset = {**yaml.safe_load((PROJECT_ROOT / "conf" / "cluster" / "this_machine.yaml").read_text()),
              "peak_tflops": 0.3, "loopback_gbytes_per_s": 1.0, "loopback_latency_us": 100}
    assert cluster_from_config(preset, None, world=1).codec_bytes_per_s > 0


def test_a_named_baseline_is_validated_as_a_row_and_the_search_leaves_baselines_out(base):  # noqa: F811
    """plan.layouts=[torch_hsdp]: its rows, beside hsdp's for the same layouts when both are named;
    with no names, no PyTorch baseline is searched."""
    config = base["tiny"]
    shape = ModelShape.from_preset(yaml.safe_load((PROJECT_ROOT / "conf" / "model" / "tiny.yaml").read_text()))
    cluster, space = synthetic_cluster(), Space(recompute=("none",), max_microbatches=1)
    rows, _ = plan_rows(shape, config, [], cluster, 4, 8, space, ["torch_hsdp"])
    assert rows and {r["layout"]["strategy"] for r in rows} == {"torch_hsdp"}
    assert all(r["layout"]["dp_shard"] == 2 and r["step_time_s"]["total"] > 0 for r in rows)
    both, _ = plan_rows(shape, config, [], cluster, 4, 8, space, ["torch_hsdp", "hsdp"])
    assert {r["layout"]["strategy"] for r in both} == {"torch_hsdp", "hsdp"} and len(both) == 2 * len(rows)
    found = enumerate_layouts(shape, config, 4, 8, space)
    assert found.candidates and not any("baseline" in c.plan.spec.tags for c in found.candidates)
