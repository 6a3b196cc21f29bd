"""launch/slurm/train.sbatch submitted, as a user would, to a throw-away Slurm cluster on this machine.

launch/slurm/local_cluster.sh starts slurmctld and two slurmd (two nodes, 2 CPUs each) under a
temporary directory, for this module, and stops every daemon and job process by pid afterwards. A
job's final state is read from the cluster's job completion file (JobCompType=jobcomp/filetxt),
not from `sbatch --wait`, which exits 0 for a cancelled job.

Where Slurm is not installed or the cluster does not start, the tests skip with the reason; CI
installs slurm-wlm and sets PARALLEL_SLURM_REQUIRED=1 (.ci/run), which turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from launcher import PROJECT_ROOT, TINY, Run, check_matches_single
from restart_job import KILL_RANK_1_AT_5, RESTART_JOB, check_repeats_reference

SCRIPT = PROJECT_ROOT / "launch" / "slurm" / "local_cluster.sh"
SBATCH = PROJECT_ROOT / "launch" / "slurm" / "train.sbatch"
NOT_ENDED = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING")
TOOLS = ("slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo", "scontrol")


def require_slurm(why: str) -> None:
    """Skip (or, under PARALLEL_SLURM_REQUIRED=1, fail) where no Slurm cluster can run here."""
    if os.environ.get("PARALLEL_SLURM_REQUIRED") == "1":
        pytest.fail(f"PARALLEL_SLURM_REQUIRED=1 but {why}")
    pytest.skip(why)


@dataclass
class Cluster:
    dir: Path

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "NPROC_PER_NODE" and not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.dir / "slurm.conf"), GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
        if Path(sys.executable) != PROJECT_ROOT / ".venv" / "bin" / "python":
            env["PYTHON"] = sys.executable  # the batch script's default is the project's .venv
        return env

    def submit(self, sbatch_args: list[str], overrides: list[str], out: Path, env: dict | None = None) -> int:
        proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", *sbatch_args, str(SBATCH), *overrides],
                              cwd=PROJECT_ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return int(proc.stdout.strip().split(";")[0])

    def record(self, job: int) -> dict[str, str] | None:
        """The job's line in the job completion file (JobState, ExitCode, ...), once it has ended
        (a requeue writes a line too, in a state that is not an end: its last line counts)."""
        comp = self.dir / "jobcomp.txt"
        if not comp.exists():
            return None
        lines = [line for line in comp.read_text().splitlines() if line.startswith(f"JobId={job} ")]
        rec = dict(field.split("=", 1) for field in lines[-1].split() if "=" in field) if lines else None
        return rec if rec and rec["JobState"] not in NOT_ENDED else None

    def wait(self, job: int, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = self.record(job)
            if rec is not None:
                return rec
            time.sleep(0.5)
        subprocess.run(["scancel", str(job)], env=self.env, timeout=10)
        raise AssertionError(f"job {job} did not end within {timeout:g} s (cancelled)")

    def run(self, sbatch_args: list[str], overrides: list[str], out: Path, timeout: float = 150) -> tuple[dict, str]:
        job = self.submit(sbatch_args, overrides, out)
        rec = self.wait(job, timeout)
        return rec, out.read_text() if out.exists() else ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        require_slurm(f"Slurm is not installed ({', '.join(missing)} not on PATH): apt-get install slurm-wlm")
    if sys.platform != "linux":
        require_slurm("the local Slurm cluster runs on Linux only")
    d = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SCRIPT), "start", str(d)], capture_output=True, text=True, timeout=90)
    try:
        if started.returncode != 0:
            require_slurm(f"the local Slurm cluster did not start: {started.stderr.strip()[-500:]}")
        yield Cluster(d)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, text=True, timeout=90)


def _job_pids(job: int) -> dict[int, list[str]]:
    """pid -> argv of every process running for this job (its environment names the job)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ:
            pids[int(proc.name)] = argv
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


LAYOUTS = {
    "dp": (["parallel=dp"], {"dp": 4, "tp": 1, "pp": 1}),
    "tp": (["parallel=tp"], {"dp": 2, "tp": 2, "pp": 1}),   # each tp pair on one node
    "pp": (["parallel=pp_1f1b", "parallel.dp=2"], {"dp": 2, "tp": 1, "pp": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_nodes_train_the_single_process_model(layout, cluster, single_run, tmp_path):
    overrides, dims = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    rec, out = cluster.run(["--cpus-per-task=2"], [*TINY, *overrides, "train.save_final=true", f"run.dir={run_dir}"],
                           tmp_path / "job.out")
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{out[-3000:]}"
    assert rec["NodeCnt"] == "2"
    assert "2 nodes x 2 processes (no GPU asked for" in out
    run = Run(0, out, "", run_dir)
    assert run.summary["world_size"] == 4
    assert {k: run.summary["parallel"][k] for k in dims} == dims
    # One rank log per process, ranks 0-1 on node 0 and 2-3 on node 1.
    for rank in range(4):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank} | node {rank // 2} | local rank {rank % 2} of 2" in log
    check_matches_single(run, single_run)


def test_a_rank_that_raises_fails_the_job(cluster, tmp_path):
    fault = ["train.fail_mode=raise", "train.fail_at_step=2", "train.fail_rank=3"]  # rank 3: on the second node
    rec, out = cluster.run(["--cpus-per-task=2"], [*TINY, "parallel=dp", *fault, f"run.dir={tmp_path / 'run'}"],
                           tmp_path / "job.out")
    assert rec["JobState"] == "FAILED", f"{rec}\n{out[-3000:]}"
    assert rec["ExitCode"] != "0:0"
    assert "error: rank 3 failed: InjectedFailure" in out


def test_scancel_mid_run_leaves_no_process(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = cluster.submit(["--cpus-per-task=2"], [*TINY, "parallel=dp", "train.steps=500", f"run.dir={run_dir}"],
                         tmp_path / "job.out")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert cluster.record(job) is None, f"job ended early: {cluster.record(job)}"
        assert time.monotonic() < deadline, "training did not reach step 1 within 120 s"
        time.sleep(0.3)
    seen = _job_pids(job)
    # Python processes only (srun's own command line names torchrun too): 2 agents, 4 ranks.
    python = {p: argv for p, argv in seen.items() if "python" in Path(argv[0]).name}
    agents = [p for p, argv in python.items() if argv[1:3] == ["-m", "torch.distributed.run"]]
    workers = [p for p, argv in python.items() if "launch.train" in argv and p not in agents]
    assert len(workers) == 4 and len(agents) == 2, seen  # the job is really running, on both nodes

    subprocess.run(["scancel", str(job)], env=cluster.env, check=True, timeout=30)
    rec = cluster.wait(job, 60)
    assert rec["JobState"] == "CANCELLED", rec
    deadline = time.monotonic() + 30
    while (left := [p for p in set(seen) | set(_job_pids(job)) if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not left, {p: seen.get(p, "?") for p in left}
    assert len(metrics.read_text().splitlines()) < 500


def _last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else -1


def _freeze_workers(job: int) -> None:
    """SIGSTOP the job's ranks, so that it is caught mid-run however fast its steps go."""
    for pid, argv in _job_pids(job).items():
        if "python" in Path(argv[0]).name and "launch.train" in argv and "torch.distributed.run" not in argv:
            os.kill(pid, signal.SIGSTOP)


def test_a_killed_rank_restarts_in_the_step_and_a_requeued_job_resumes(cluster, restart_reference, tmp_path):
    """MAX_RESTARTS=1: rank 1 SIGKILLs itself before step 5 and torchrun restarts every rank inside
    the job step; once the restarted ranks have logged step 6 they are frozen and the job is
    requeued (`scontrol requeue`, its start made due at once): the batch script runs again under
    the same job id and resumes from the job's newest checkpoint. Losses and final parameters
    equal the uninterrupted run's bitwise."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit(["--cpus-per-task=2"], [*RESTART_JOB, *KILL_RANK_1_AT_5, f"run.dir={run_dir}"], out,
                         env={"MAX_RESTARTS": "1"})
    deadline = time.monotonic() + 150
    while _last_step(run_dir / "metrics.jsonl") < 6:
        assert cluster.record(job) is None, f"job ended early: {cluster.record(job)}\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the restarted job did not reach step 6 within 150 s"
        time.sleep(0.05)
    _freeze_workers(job)
    assert _last_step(run_dir / "metrics.jsonl") < 9, "the job ended before it could be requeued"
    subprocess.run(["scontrol", "requeue", str(job)], env=cluster.env, check=True, timeout=30)
    # A requeued job waits about two minutes before it may start again; make it due now.
    while subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], env=cluster.env, capture_output=True,
                         text=True, timeout=10).stdout.strip() != "PENDING":
        assert time.monotonic() < deadline + 60, "the requeued job did not become pending"
        time.sleep(0.2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env, check=True, timeout=30)
    rec = cluster.wait(job, 150)
    text = out.read_text()
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{text[-3000:]}"
    assert "rank 1: injecting train.fail_mode=kill at step 5" in text and f"job {job} (start 1)" in text, text[-3000:]
    check_repeats_reference(Run(0, text, "", run_dir).summary, restart_reference.summary)


@pytest.mark.parametrize("sbatch_args,overrides,error", [
    # A layout launch.train refuses, refused by the batch script before any agent starts.
    (["--cpus-per-task=2"], ["parallel=tp", "parallel.dp=3"],
     r"error: world size 4 != parallel\.dp x parallel\.tp x parallel\.pp = 3 x 2 x 1 = 6: "
     r".* \(2 nodes x 2 processes = world 4\)"),
    # tp 2 over nodes of 1 process: each tensor-parallel pair would span two nodes.
    (["--cpus-per-task=1"], ["parallel=tp"], r"error: parallel\.tp=2 does not divide the 1 processes per node"),
    # Neither GPUs nor CPUs asked for, and no NPROC_PER_NODE: no processes to start.
    ([], ["parallel=dp"], r"error: the allocation gives no processes per node: ask for GPUs"),
])
def test_a_refused_configuration_fails_the_job_in_one_line(cluster, tmp_path, sbatch_args, overrides, error):
    rec, out = cluster.run(sbatch_args, [*TINY, *overrides, f"run.dir={tmp_path / 'run'}"], tmp_path / "job.out",
                           timeout=60)
    assert rec["JobState"] == "FAILED", f"{rec}\n{out}"
    assert rec["ExitCode"] == "2:0", rec
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(error + ".*", errors[0]), out
    assert "torch.distributed" not in out and not (tmp_path / "run").exists()  # nothing was started
