"""lab/handoffs.py, the handoff of every point-to-point message in a run's last step, on traces
with known answers: what it reads from a run's trace.json and summary.json, and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launcher import PROJECT_ROOT


def _span(rank: int, op: str, kind: str, tag: str, ts: float, dur: float) -> dict:
    return {"name": f"{op} {tag}", "cat": f"comm,pp,{kind}", "ph": "X", "pid": rank, "tid": 1 if kind == "wait" else 2,
            "ts": ts, "dur": dur, "args": {"op": op, "group": "pp", "tag": tag, "kind": kind,
                                           "payload_bytes": 32768, "sent_bytes": 0.0}}


def _run_dir(tmp_path, events: list[dict]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    link = {"name": "loopback", "intra": {"p2p_latency_s": 127e-6}, "inter": None}
    (tmp_path / "summary.json").write_text(json.dumps({"virtual": {"link_model": link}}))
    return tmp_path


def handoffs(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab.handoffs", *map(str, args)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=60, env=os.environ.copy())


def test_each_message_is_timed_from_both_sides_ready_to_the_waits_end(tmp_path):
    fwd, bwd = "pp/fwd/0->1", "pp/bwd/1->0"
    events = [
        # The receiver waits first (from 50 µs); the send is handed over at 110: 100 µs to the wait's end.
        _span(0, "send", "post", fwd, 100, 10), _span(1, "recv", "wait", fwd, 50, 160),
        # The send first (done at 305); the receiver waits from 400: 20 µs.
        _span(0, "send", "post", fwd, 300, 5), _span(1, "recv", "wait", fwd, 400, 20),
        # The data was there before the send's post returned: no handoff, not a negative one.
        _span(1, "send", "post", bwd, 500, 50), _span(0, "recv", "wait", bwd, 510, 30),
        # A batched call is listed once per op it carries: counted once.
        _span(1, "send", "post", bwd, 600, 10), _span(1, "send", "post", bwd, 600, 10),
        _span(0, "recv", "wait", bwd, 700, 1000), _span(0, "recv", "wait", bwd, 700, 1000),
        # Posts of receives, waits on sends and other ops are not messages' handoffs.
        _span(0, "recv", "post", bwd, 0, 1), _span(1, "send", "wait", bwd, 0, 1),
        {"name": "forward", "cat": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 90},
    ]
    proc = handoffs(_run_dir(tmp_path, events))
    assert proc.returncode == 0, proc.stderr
    # 100, 20, 0 and 1000 µs.
    assert proc.stdout.strip() == (f"{tmp_path}: 4 messages | handoff median 60 µs, 90th percentile 1000 µs, "
                                   "max 1000 µs, sum 1.1 ms | the link model's message latency 127 µs")


def test_runs_without_messages_and_bad_input(tmp_path):
    quiet = _run_dir(tmp_path / "dp", [{"name": "forward", "cat": "forward", "ph": "X", "pid": 0, "tid": 0,
                                        "ts": 0, "dur": 90}])
    assert handoffs(quiet).stdout.strip() == f"{quiet}: no point-to-point messages in its last step"

    proc = handoffs(tmp_path / "nowhere")
    assert proc.returncode == 2 and f"error: no trace.json in {tmp_path / 'nowhere'}" in proc.stderr
    assert handoffs().returncode == 2

    unmatched = _run_dir(tmp_path / "cut", [_span(0, "send", "post", "pp/fwd/0->1", 0, 1),
                                            _span(0, "send", "post", "pp/fwd/0->1", 5, 1),
                                            _span(1, "recv", "wait", "pp/fwd/0->1", 0, 9)])
    proc = handoffs(unmatched)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {unmatched}: pp/fwd/0->1: 2 sends posted but 1 receives waited on"
