"""The GPU paths' decisions, proven on the CPU; what only a GPU can show is marked `gpu`.

Each test here holds the part of a CUDA code path that a CPU can reach: which clock a call is
timed by, what is reset and when, which verdict a run may claim on CUDA. The tests marked `gpu`
run the same functions on a GPU (`launch/gpu_check.sh` runs them) and skip with their reason
elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from parallel.report.metrics import peak_memory_bytes, peak_memory_scope, reset_peak_memory

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; none is visible on this machine")


def _refuse(*_args, **_kwargs):
    raise AssertionError("a CUDA function was called on the CPU path")


# -- the peak memory is the timed steps' ------------------------------------------------------------
def test_the_peak_reset_is_a_no_op_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", _refuse)
    before = peak_memory_bytes(torch.device("cpu"))
    assert reset_peak_memory(torch.device("cpu")) is False
    assert peak_memory_bytes(torch.device("cpu")) >= before  # the peak RSS only grows
    assert peak_memory_scope("cpu").startswith("the whole process")
    assert peak_memory_scope("cuda").startswith("the timed steps")


@pytest.mark.gpu
@needs_gpu
def test_the_peak_reset_forgets_what_came_before_on_cuda():
    device = torch.device("cuda", 0)
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    del big
    assert peak_memory_bytes(device) >= 64 * 2**20
    assert reset_peak_memory(device) is True
    assert peak_memory_bytes(device) == torch.cuda.memory_allocated(device) < 64 * 2**20


# -- the activation check: against the CPU kernel's saved tensors, or not at all -------------------
def _memory(device_type: str, measured: int, formula: int) -> dict:
    from parallel.activations import activation_check_note
    from parallel.report.summary import summarize_memory

    state = {"param_bytes": 1, "grad_bytes": 1, "optimizer_bytes": 2, "peak_model_state_bytes": 4}
    report = {"rank": 0, "model_state": state, "activation_peak_bytes": measured, "peak_memory_bytes": 10}
    return summarize_memory([report], None, [formula], activation_check_note(device_type))


def test_the_activation_formula_is_held_to_the_cpu_kernel_and_not_claimed_on_cuda():
    assert _memory("cpu", 100, 100)["activations_match_theory"] is True
    assert _memory("cpu", 100, 101)["activations_match_theory"] is False
    assert _memory("cpu", 100, 100)["activations_check_note"] is None
    cuda = _memory("cuda", 100, 101)
    # Not false: the formula does not describe what CUDA's attention kernels save.
    assert cuda["activations_match_theory"] is None
    assert cuda["activations_check_note"].startswith("not checked on CUDA: ")
    assert cuda["activations_bytes_measured"] == [100] and cuda["theory"]["activation_bytes"] == [101]


# -- NCCL's failures end in the same one line as gloo's ----------------------------------------------
# NCCL's texts as torch 2.13 writes them (ProcessGroupNCCL.cpp: WorkNCCL::checkTimeout and
# operator<<, checkForNCCLErrorsInternal; NCCLUtils.cpp: NCCLComm::getNcclComm,
# ncclGetErrorWithVersion, getNcclErrorDetailStr; NCCL's ncclGetErrorString).
NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60004 milliseconds before timing out.")
NCCL_ABORTED = f"NCCL communicator was aborted on rank 1.  Original reason for failure was: {NCCL_TIMEOUT}"
NCCL_REMOTE = ("NCCL error: remote process exited or there was a network error, NCCL version 2.27.5\n"
               "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
               "prematurely.\nLast error:\nsocketProgress: Connection closed by remote peer gpu02<45678>")
NCCL_SYSTEM = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system "
               "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclSystemError: System call "
               "(e.g. socket, malloc) or external library call failed or device error. \nLast error:\n"
               "socketPollConnect: connect returned Connection refused")
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv"
GLOO_CLOSED = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5678. "
               "This is typically caused by a peer that exited")


def test_nccl_and_gloo_failures_read_as_one_line_of_one_kind():
    from parallel.dist.failures import PEER, TIMEOUT, failure_kind, failure_line, watchdog_verdict

    timeout = ("Timed out: NCCL's watchdog stopped ALLREDUCE (collective 7 of its group) after 60.0 s, past the "
               "group's timeout of 60 s")
    expected = {
        NCCL_TIMEOUT: (timeout, TIMEOUT),
        NCCL_ABORTED: (f"{timeout}; it aborted the group's communicators", TIMEOUT),
        NCCL_REMOTE: ("NCCL error: remote process exited or there was a network error (NCCL 2.27.5; last error: "
                      "socketProgress: Connection closed by remote peer gpu02<45678>)", PEER),
        NCCL_SYSTEM: ("NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details) (NCCL 2.27.5; "
                      "last error: socketPollConnect: connect returned Connection refused)", None),
        GLOO_TIMEOUT: ("Timed out waiting 60000ms for recv", TIMEOUT),
        GLOO_CLOSED: ("Connection closed by peer [127.0.0.1]:5678", PEER),
    }
    for text, (line, kind) in expected.items():
        assert failure_line(torch.distributed.DistBackendError(text)) == line
        assert failure_line(line) == line  # a line already read stays as it is
        assert failure_kind(line) == kind, line
    assert failure_kind(watchdog_verdict("TIMEOUT")) == TIMEOUT
    assert failure_kind(watchdog_verdict("REMOTE_ERROR")) == PEER


def test_an_nccl_failure_ends_in_the_error_line_that_names_the_call():
    from parallel.dist.comm import CommFailure
    from parallel.reliability.faults import describe_failure

    call = "all_reduce 'grads/bucket0' over group dp (ranks [0, 1])"
    hung = describe_failure(CommFailure(f"{call}: Timed out: NCCL ALLREDUCE ..."), 0, 60)
    assert hung.startswith(f"rank 0 stopped: {call}: Timed out: NCCL ALLREDUCE ...: waited parallel.timeout_s=60 s")
    # Raised outside comm.py (a baseline's own wait): NCCL's text, read all the same.
    raw = describe_failure(torch.distributed.DistBackendError(NCCL_ABORTED), 1, 60)
    assert raw.startswith("rank 1 stopped: Timed out: NCCL's watchdog stopped ALLREDUCE (collective 7 of its group)")
    assert "\n" not in raw
    died = describe_failure(torch.distributed.DistBackendError(NCCL_REMOTE), 1, 60)
    assert died.startswith("rank 1 stopped: NCCL error: remote process exited") and "crashed or was killed" in died


def test_a_call_on_a_group_the_watchdog_aborted_says_why_from_the_group_s_error():
    """The watchdog aborts the communicators without a reason (WorkNCCL::abort, abortComms): the
    next call says only "NCCL communicator was aborted on rank 1."; the error the watchdog recorded
    on the group (ErrorType) completes the line."""
    from parallel.dist.comm import _failed
    from parallel.reliability.faults import describe_failure

    class Group:
        name, global_ranks = "dp", [0, 1]

        def __init__(self, recorded):
            self.recorded = recorded

        def watchdog_error(self):
            return self.recorded

    aborted = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1. ")
    line = str(_failed(Group("TIMEOUT"), "all_reduce", "grads/bucket0", aborted))
    assert line == ("all_reduce 'grads/bucket0' over group dp (ranks [0, 1]): Timed out: a collective of the group "
                    "ran past its timeout; NCCL's watchdog aborted the group's communicators (NCCL communicator was "
                    "aborted on rank 1 (NCCL's watchdog found its group failed))")
    assert "waited parallel.timeout_s=60 s" in describe_failure(_failed(Group("TIMEOUT"), "all_reduce", "x", aborted),
                                                                1, 60)
    plain = str(_failed(Group(None), "all_reduce", "grads/bucket0", aborted))
    assert plain.endswith(": NCCL communicator was aborted on rank 1 (NCCL's watchdog found its group failed)")


def test_nccl_groups_are_made_with_the_watchdog_leaving_the_process_up(monkeypatch):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2 is in the environment when the first NCCL group is made
    (torchrun sets 1: the watchdog would take the process down, with no error line)."""
    import torch.distributed as dist

    from parallel.dist.comm import CommLog
    from parallel.dist.dims import ParallelDims
    from parallel.dist.groups import LaunchEnv, init_distributed

    seen = {}

    def made(**kwargs):
        seen.update(backend=kwargs["backend"], handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        raise _Stop

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(dist, "init_process_group", made)
    monkeypatch.setattr("parallel.dist.groups.attempt_store", lambda env, timeout: None)  # no torchrun store here
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(_Stop):
        init_distributed(env, ParallelDims(world_size=2, dp=2), "nccl", 60, CommLog(), device_type="cpu")
    assert seen == {"backend": "nccl", "handling": "2"}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    with pytest.raises(_Stop):  # gloo's groups: nothing of NCCL's is touched
        init_distributed(env, ParallelDims(world_size=2, dp=2), "gloo", 60, CommLog(), device_type="cpu")
    assert seen == {"backend": "gloo", "handling": "1"}


class _Stop(Exception):
    """Raised in place of making the process group: what was set before it is what the test reads."""


def test_a_flag_read_after_the_watchdog_failed_the_group_is_no_nonfinite_verdict():
    """Under NCCL a hung finite check returns, garbage and all, once the watchdog aborts the group:
    the guard says which call failed, not "non-finite loss"."""
    from parallel.core.model import GPT, GPTConfig
    from parallel.dist.comm import CommFailure
    from parallel.strategy import NonFiniteLoss, SingleProcess, make_optimizer

    class AbortedWorld:
        """The world group after NCCL's watchdog aborted it: the flag comes back set."""
        size, name = 2, "world"

        def __init__(self, failure):
            self.failure = failure

        def all_reduce(self, flag, tag, op):
            flag.fill_(1.0)

        def backend_failure(self, op, tag):
            return self.failure

    model = GPT(GPTConfig(), seed=0)
    strategy = SingleProcess(model, make_optimizer(model, 1e-3, 0.1))
    strategy.finite_comm = AbortedWorld(CommFailure("all_reduce 'tooling/finite' over group world: Timed out: ..."))
    with pytest.raises(CommFailure, match="tooling/finite"):
        strategy.guard_finite(torch.tensor(2.0))
    strategy.finite_comm = AbortedWorld(None)  # a group that is fine: the flag is the ranks' verdict
    with pytest.raises(NonFiniteLoss):
        strategy.guard_finite(torch.tensor(2.0))


# -- the sweep's parent holds no CUDA context -------------------------------------------------------
# What initialises CUDA in a process (torch 2.13): torch.cuda's lazy init, and cudaGetDeviceCount
# behind torch.cuda.is_available() (device_count() asks NVML first, and CUDA where NVML fails).
CUDA_ENTRY_POINTS = ("_lazy_init", "init", "is_available", "device_count", "get_device_name",
                     "get_device_properties", "synchronize", "empty_cache", "set_device", "current_device")


def _no_cuda_in_this_process(monkeypatch) -> None:
    for name in CUDA_ENTRY_POINTS:
        monkeypatch.setattr(torch.cuda, name, _refuse)
    for name in ("_cuda_init", "_cuda_getDeviceCount"):
        monkeypatch.setattr(torch._C, name, _refuse, raising=False)


def test_the_sweep_asks_a_child_for_the_gpus_and_never_cuda_itself(monkeypatch):
    """A CUDA build (faked: the flag of the build is all the parent reads) asks a child process; the
    parent's own path calls nothing that would initialise CUDA."""
    import json
    import sys

    from parallel.compare.devices import probe_command, sweep_machine

    _no_cuda_in_this_process(monkeypatch)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)

    def child(facts: dict) -> list[str]:
        return [sys.executable, "-c", f"print({json.dumps(json.dumps(facts))})"]

    gpus = {"gpus": 2, "names": ["NVIDIA H100 80GB HBM3"] * 2, "peak_flops": 9.5e14}
    machine = sweep_machine("bf16", command=child(gpus))
    assert (machine.device_type, machine.gpus, machine.name, machine.peak_flops) == \
        ("cuda", 2, "NVIDIA H100 80GB HBM3", 9.5e14)
    assert machine.capacity == (2, "GPUs")
    assert sweep_machine(None, command=child({"gpus": 0, "names": [], "peak_flops": None})).device_type == "cpu"
    with pytest.raises(RuntimeError, match="asking CUDA for the GPUs failed in a child process .*no driver"):
        sweep_machine(None, command=[sys.executable, "-c", "import sys; sys.exit('no driver')"])
    assert probe_command("bf16")[1:] == ["-m", "parallel.compare.devices", "bf16"]


def test_the_sweep_parent_and_the_pool_ranks_name_no_cuda_call():
    """Read, not run: the parent's modules (and devices.py outside the child's `probe`) never touch
    torch.cuda, whatever machine they run on."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in ("launch/compare.py", "launch/forkserver.py", "parallel/compare/pool.py",
                 "parallel/compare/devices.py"):
        tree = ast.parse((root / path).read_text())
        child = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "probe"]
        in_child = {id(n) for f in child for n in ast.walk(f)}
        calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in in_child
                 and ast.unparse(n).startswith("torch.cuda.") and "is_initialized" not in ast.unparse(n)]
        assert calls == [], (path, calls)


def test_a_pool_rank_with_cuda_initialised_refuses_to_fork(monkeypatch):
    from launch.forkserver import cuda_refusal

    assert cuda_refusal() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "initialised CUDA before forking" in cuda_refusal()


# -- the baselines' waits, on the clock of the stream that runs the step ----------------------------
def _events(seconds: float):
    """A stand-in for commlog.DeviceInterval (two CUDA events on the current stream) that a CPU can
    make: its stamps are labels, its time a given figure, read only when the step resolves it."""
    from parallel.dist.comm import DeviceInterval

    class Events(DeviceInterval):
        def __init__(self):
            self._start, self._end = "start event", "end event"

        def seconds(self) -> float:
            return seconds

    return Events()


def test_a_baseline_call_is_charged_by_the_clock_of_its_device():
    from parallel.baselines.counting import HostInterval, call_interval, charge
    from parallel.dist.comm import CommLog

    log = CommLog()
    log.begin_step()
    host = call_interval(cuda=False)
    assert isinstance(host, HostInterval)
    charge(log, ("recv", "pp", "pipelining/recv"), host.stop())
    charged_now = log._current[("recv", "pp", "pipelining/recv")].seconds
    assert charged_now == host.seconds() >= 0
    # CUDA events: nothing read during the step (it would synchronise), their time at its end.
    charge(log, ("all_reduce", "tp", "dtensor/all_reduce"), _events(0.25))
    assert log._current[("all_reduce", "tp", "dtensor/all_reduce")].seconds == 0.0
    traffic = log.end_step()
    assert traffic[("all_reduce", "tp", "dtensor/all_reduce")].seconds == 0.25


def test_a_batch_of_pipeline_posts_is_counted_once_on_either_clock():
    from parallel.baselines.counting import HostInterval, PipelineP2PCounter

    host = HostInterval()
    host._start, host._end = 10.0, 10.3
    shares = PipelineP2PCounter.op_stamps(host, 3)
    assert [round(b - a, 9) for a, b in shares] == [0.1, 0.1, 0.1] and shares[0][0] == 10.0
    # Events cannot be cut: the first op holds the whole interval, the others none, at its end.
    assert PipelineP2PCounter.op_stamps(_events(0.3), 3) == [("start event", "end event"),
                                                             ("end event", "end event"), ("end event", "end event")]


def test_calls_on_a_side_stream_are_counted_but_not_timed():
    """FSDP2's collectives on CUDA run on its own streams: their bytes are logged, their time is not
    the step's wait (the summary then says exposed comm is not measured)."""
    from parallel.baselines.fsdp2 import _side_stream_call
    from parallel.dist.comm import CommLog

    log = CommLog()

    class Comm:
        pass

    comm = Comm()
    comm.log = log
    with _side_stream_call(comm, torch.zeros(1)):  # the CPU: no side stream, timed as any call
        assert log.timed
    with log.untimed():
        assert not log.timed and not log.spanning
        log.record("all_gather", "dp", "fsdp2/param_all_gather/root", 64, 2, 0.0)
    assert log.timed and log._current[("all_gather", "dp", "fsdp2/param_all_gather/root")].payload_bytes == 64


BASELINE_COUNTER_ON_CUDA = """
import os, torch, torch.distributed as dist
from parallel.baselines.counting import FunctionalCollectiveCounter
from parallel.dist.comm import CommLog, Communicator, DeviceInterval
from parallel.dist.timing import StepClock
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
log = CommLog()
comm = Communicator("tp", dist.group.WORLD, log)
log.clock = StepClock(torch.device("cuda", 0))
log.begin_step()
log.clock.begin_step()
x = torch.ones(1 << 20, device="cuda")
with FunctionalCollectiveCounter(log, [comm], "dtensor"):
    y = torch.ops._c10d_functional.all_reduce(x, "sum", dist.group.WORLD.group_name)
    y = torch.ops._c10d_functional.wait_tensor(y)
log.clock.end_step()
traffic = log.end_step()
spans = log.last_spans
assert [s["kind"] for s in spans] == ["call", "wait"], spans
assert all(0 <= s["start"] <= s["end"] for s in spans), spans
assert traffic[("all_reduce", "tp", "dtensor/all_reduce")].calls == 1
print("ok", traffic[("all_reduce", "tp", "dtensor/all_reduce")].seconds)
dist.destroy_process_group()
"""


@pytest.mark.gpu
@needs_gpu
def test_a_dtensor_collective_is_timed_by_cuda_events_on_a_gpu():
    """DTensor's functional all-reduce and its wait, counted on a one-rank NCCL group: spans on the
    step's CUDA clock, the record's time resolved from events at the step's end."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BASELINE_COUNTER_ON_CUDA], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]
