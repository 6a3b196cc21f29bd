"""parallel/net/predict.py's model of where gloo's collectives send their bytes, and the link model's
tc arithmetic, checked in-process (no network; milliseconds). The end-to-end check that these
figures match the kernel's counters is tests/tools/test_net.py.
"""

import pytest

from parallel.dist.comm import ring_bytes_sent
from parallel.net import predict
from parallel.net.shaping import loss_bytecode, tbf_args
from parallel.net.topology import NetConfigError, NetSpec


def _sent(op, payload, n, i, tag=""):
    return sum(t.nbytes * t.count for t in predict.transfers(op, payload, n, i, tag))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("payload", [4, 256, 4100, 939520, 5 << 20])
def test_ring_all_reduce_sends_what_the_ring_formula_counts_all_to_the_left(n, payload):
    # Over the group, gloo's segments add up to comm.py's 2(n-1)/n * S per rank exactly: every
    # rank sends every segment but one chunk's in each phase, so each segment n-1 times per phase.
    total = sum(_sent("all_reduce", payload, n, i) for i in range(n))
    assert total == 2 * (n - 1) * payload == ring_bytes_sent("all_reduce", payload, n) * n
    for i in range(n):
        assert {t.to for t in predict.transfers("all_reduce", payload, n, i)} <= {(i - 1) % n}
    # gloo's reduce-scatter is that all-reduce on the full input: twice the ring reduce-scatter.
    reduce_scatter = sum(_sent("reduce_scatter", payload, n, i) for i in range(n))
    assert reduce_scatter == 2 * ring_bytes_sent("reduce_scatter", payload, n) * n


@pytest.mark.parametrize("n", [2, 3, 5])
def test_ring_all_gather_and_binomial_broadcast(n):
    payload = 1200 * n
    for i in range(n):
        assert _sent("all_gather", payload, n, i) == ring_bytes_sent("all_gather", payload, n)
        assert {t.to for t in predict.transfers("all_gather", payload, n, i)} == {(i + 1) % n}
    # The tree reaches every member but the root exactly once.
    received = [t.to for i in range(n) for t in predict.transfers("broadcast", payload, n, i)]
    assert sorted(received) == list(range(1, n))


def test_sends_go_to_the_peer_their_tag_names():
    assert predict.transfers("send", 100, 2, 1) == [predict.Transfers(0, 100, 1)]
    # Virtual stage 5 -> 6 of a 4-rank pipeline: stage 6 lives on pp rank 2.
    assert predict.transfers("send", 100, 4, 1, "pp/fwd/5->6") == [predict.Transfers(2, 100, 1)]
    assert predict.transfers("send", 100, 4, 2, "pipelining/send/2->1") == [predict.Transfers(1, 100, 1)]
    assert predict.transfers("recv", 100, 4, 2, "pp/fwd/1->2") == []
    with pytest.raises(predict.PredictionError, match="does not name its peer"):
        predict.transfers("send", 100, 4, 0, "grads/x")


def test_a_step_splits_into_inter_and_intra_node_bytes():
    # dp 4 over 2 nodes of 2 (ranks 0,1 | 2,3): gloo's ring sends i -> i-1, so 0 -> 3 and 2 -> 1
    # cross the link and 1 -> 0, 3 -> 2 stay on the loopback.
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    groups = {r: {"dp": [0, 1, 2, 3]} for r in range(4)}
    step = {("all_reduce", "dp", "grads/bucket0"): {"calls": 1, "payload_bytes": 4 << 20}}
    mtu = {"inter": 65535, "intra": 65536}
    figures = predict.per_step({r: [step, step] for r in range(4)}, groups, node_of, mtu)
    # Each rank sends 2(n-1)/n * S = 1.5 S a step; two of the four ranks across the link.
    assert figures["inter"]["payload"] == figures["intra"]["payload"] == 2 * 1.5 * (4 << 20)
    # Framing: ~400 bytes per transfer, a fraction of a percent of these 1 MiB segments.
    assert 1 < figures["inter"]["wire"] / figures["inter"]["payload"] < 1.005


def test_framing_of_one_transfer():
    # A 4-byte transfer: three 48-byte gloo headers, the data frame, both notices' frames and two
    # ACKs, 66 bytes of headers each (measured on the emulated link: ~430 bytes).
    assert predict.framing(4, 65535) == 3 * 48 + 66 * (1 + 2 + 1)
    # 1 MiB: 17 frames at a 64 KiB MTU (headers ~0.2%).
    assert predict.framing(1 << 20, 65535) == 3 * 48 + 66 * (17 + 2 + 9)
    # On the loopback the counters see no Ethernet header: 52 bytes a frame.
    assert predict.framing(4, 65536, predict.FRAME_HEADERS["intra"]) == 3 * 48 + 52 * (1 + 2 + 1)


def test_loss_filter_threshold_and_tbf_arithmetic():
    # ld rand; jgt #T; ret -1; ret 0: matches (T + 1) / 2^32 of frames.
    code = loss_bytecode(1.0).split(",")
    threshold = int(code[2].split()[3])
    assert (threshold + 1) / 2**32 == pytest.approx(0.01, rel=1e-9)
    args = dict(zip(tbf_args(200)[::2], tbf_args(200)[1::2]))
    assert args["rate"] == "200000kbit" and int(args["burst"]) >= 65535 and int(args["limit"]) >= 32 << 20


@pytest.mark.parametrize("field,value,message", [
    ("inter_mbit", -1, "net.inter_mbit=-1 must be a positive number of Mbit/s"),
    ("loss_pct", 100, "net.loss_pct=100 must be below 100"),
    ("procs_per_node", 0, "net.procs_per_node=0 must be an integer >= 1"),
    ("latency_ms", -2, "net.latency_ms=-2 must be >= 0"),
])
def test_net_settings_are_validated(field, value, message):
    settings = {"name": "x", "nodes": 2, "procs_per_node": 1, "inter_mbit": 100, "intra_mbit": None,
                "latency_ms": 0, "loss_pct": 0, "timeout_s": 60, field: value}
    with pytest.raises(NetConfigError, match=message):
        NetSpec.from_config(settings)


def test_none_cannot_carry_link_settings():
    with pytest.raises(NetConfigError, match="net=none runs on this machine's own network"):
        NetSpec.from_config({"name": "none", "nodes": 2, "procs_per_node": 1, "inter_mbit": None, "intra_mbit": None,
                             "latency_ms": 0, "loss_pct": 0, "timeout_s": 60})


def test_an_uneven_all_to_all_sends_what_the_log_says_it_sent():
    # An MoE router's splits: rank 0 of 2 keeps 3 of its 4 rows' worth and sends 1 (the log's exact
    # `sent`); with even splits, S/n to each other member.
    assert predict.transfers("all_to_all", 4000, 2, 0, sent=1000) == [predict.Transfers(1, 1000, 1)]
    assert predict.transfers("all_to_all", 4000, 4, 1) == [predict.Transfers(j, 1000, 1) for j in (0, 2, 3)]
    step = {("all_to_all", "ep", "moe/dispatch"): {"calls": 2, "payload_bytes": 8000, "sent_bytes": 3000}}
    figures = predict.step_bytes(step, {"ep": [0, 1]}, 0, {0: 0, 1: 1}, {"inter": 65535, "intra": 65536})
    assert figures["inter"]["payload"] == 3000 and figures["intra"]["payload"] == 0
