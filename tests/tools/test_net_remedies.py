"""Two of the remedies for slow links on two emulated nodes at 200 Mbit/s (docs/interconnect-remedies.md):
bytes only, read off the kernel's link counters and the communication log; nothing is timed.

- DiLoCo at H = 50 (`diloco_h50`) puts at least 40x fewer bytes per step on the inter-node link than
  dp: its 50 timed steps hold one outer all-reduce of the whole model, dp's every step holds one.
  dp's figure is its closed form (every byte of dp's all-reduce crosses between 2 nodes of 1 rank),
  which test_net.py's dp-2x1 case shows the counters and the log agree with on this very network.
- int8 gradients (`dp_int8`) send the closed form's bytes, payload and block scales: the log exactly,
  on the link (all of it crosses) the closed form plus the step's few scalars, the counters within the
  3% the other net tests allow for TCP's framing.

HSDP's inter-node bytes on the emulated links are test_net.py's `hsdp-2x2` case. Cost: 2 jobs on
2 nodes x 1 rank (4 processes of torch each), 6-7 s each on 2 idle cores (14-30 s under load).
"""

from launcher import TINY
from net_launcher import require_network, run_net

from parallel.algebra import all_reduce_sent_per_rank

SLOW_2X1 = ["net=ethernet_1g", "net.inter_mbit=200"]
H = 50
SCALARS = 256  # bytes a step may add beside the gradients: the loss and finite-flag all-reduces (4 bytes each)


def _within(measured: float, predicted: float, rel: float = 0.03) -> bool:
    return abs(measured - predicted) <= rel * predicted


def _run(tmp_path, overrides: list[str]) -> dict:
    require_network()
    run = run_net([*TINY, *SLOW_2X1, *overrides], tmp_path / "run")
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    summary = run.summary
    assert summary["comm_matches_theory"], summary["expected_comm"]
    net = summary["net"]
    # The counters saw at least the logged payload, and at most its framed prediction (+3%): a step of
    # a few scalars is mostly framing, which TCP packs tighter than the prediction (ACKs ride along).
    assert net["logged_inter_payload_bytes_per_step"] <= net["wire_inter_bytes_per_step"], net["by_link_class"]
    assert net["wire_inter_bytes_per_step"] <= 1.03 * net["logged_inter_bytes_per_step"], net["by_link_class"]
    return summary


def test_diloco_at_h50_moves_at_least_40x_fewer_inter_node_bytes_per_step_than_dp(tmp_path):
    """50 timed steps after 2 warm-up: one sync (after step 50) among them, so the counters' mean per
    step is one whole-model all-reduce over 50, plus the scalars every step."""
    summary = _run(tmp_path, ["parallel=diloco_h50", f"train.steps={H + 2}", "train.warmup_steps=2"])
    net, world = summary["net"], summary["world_size"]
    assert net["timed_steps"] == H and summary["expected_comm"]["period_steps"] == H
    dp_per_step = world * all_reduce_sent_per_rank(world, 4 * summary["model"]["parameters"])
    # The log: exactly one sync of the closed form's bytes in the timed steps, beside the scalars.
    (sync,) = summary["expected_comm"]["sent_bytes_per_fragment_sync"]  # one fragment: the whole model
    one_sync = int(sync["sent_bytes_exact"])
    assert one_sync == dp_per_step
    logged = net["logged_inter_payload_bytes_per_step"]
    assert one_sync / H <= logged <= one_sync / H + SCALARS, logged
    # The link: at least 40x fewer bytes per step than dp's, in the log and on the counters.
    for measured in (net["logged_inter_bytes_per_step"], net["wire_inter_bytes_per_step"]):
        assert 40 * measured <= dp_per_step, (measured, dp_per_step)


def test_int8_gradients_send_the_closed_forms_bytes_on_the_inter_node_link(tmp_path):
    """dp_int8 on 2 x 1: every byte of its reduction (the int8 blocks and their fp32 scales) crosses."""
    summary = _run(tmp_path, ["parallel=dp_int8"])
    net, comm, expected = summary["net"], summary["comm"], summary["expected_comm"]
    assert summary["parallel"]["comm_dtype"] == "int8"
    # The log equals the closed form exactly, op by op, every step.
    assert comm["sent_bytes_per_step_exact"] == expected["sent_bytes_per_step_exact"]
    for op, block in expected["by_op"].items():
        assert comm["by_op"][op]["sent_bytes"] == int(block["sent_bytes_exact"]), op
    closed_form = expected["sent_bytes_per_step"]
    fp32 = summary["world_size"] * all_reduce_sent_per_rank(2, 4 * summary["model"]["parameters"])
    assert fp32 * 65 / 256 <= closed_form < fp32 * 0.3  # 1 byte a value and 4 per block of 256, padded
    # The link carried the closed form (and the scalars); the counters agree with the log within 3%.
    assert closed_form <= net["logged_inter_payload_bytes_per_step"] <= closed_form + SCALARS
    assert _within(net["wire_inter_bytes_per_step"], net["logged_inter_bytes_per_step"]), net["by_link_class"]
