"""docker/Dockerfile.cpu built and run with podman, and docker/compose.yaml's two containers as two nodes.

No image registry is needed: the Dockerfile's base (python:3.11-slim) is made from Debian's
packages with mmdebstrap (bookworm: python3 3.11, a venv first on PATH as in the official image)
and imported under that name, unless an image of that name is already there. torch comes from a
local wheel directory (`pip download torch==2.13.0` into .whl/, the build argument TORCH_WHEELS);
the project's other requirements come from PyPI, with the host's CA bundle mounted into the build.
podman runs with runc and no default ulimits (a temporary CONTAINERS_CONF). The image is built once
per session; both runs compare their losses with a single-process run in the same image (the data
is the image's Python standard library, not the host's).

Docker/podman/mmdebstrap/podman-compose missing: the tests skip with the reason; CI installs them and
sets PARALLEL_CONTAINERS_REQUIRED=1 (.ci/run), which turns that skip into a failure.
docker/Dockerfile.cuda cannot be built here (no GPU base image): tests/tools/test_cluster_files.py lints both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from launcher import PROJECT_ROOT, max_rel_diff

IMAGE = "parallel-sandbox:cpu"  # docker/compose.yaml's image name
BASE = "docker.io/library/python:3.11-slim"
TORCH_VERSION = torch.__version__.split("+")[0]
TOOLS = ("podman", "runc", "mmdebstrap", "podman-compose")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# The same run as docker/compose.yaml's command, on one node: model=tiny, 6 steps.
RUN = ["model=tiny", "train.steps=6"]


def require_containers(why: str) -> None:
    if os.environ.get("PARALLEL_CONTAINERS_REQUIRED") == "1":
        pytest.fail(f"PARALLEL_CONTAINERS_REQUIRED=1 but {why}")
    pytest.skip(why)


def _run(cmd: list[str], env: dict, timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory) -> dict:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        require_containers(f"{', '.join(missing)} not on PATH: apt-get install podman runc mmdebstrap podman-compose")
    if os.geteuid() != 0:
        require_containers("the container tests run podman as root (mmdebstrap and podman import of a root filesystem)")
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    # runc: Debian's crun stops at "cgroups in hybrid mode not supported"; no default ulimits:
    # raising them needs CAP_SYS_RESOURCE, which a container host may not give.
    conf.write_text('[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n')
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    probe = _run(["podman", "info"], env, 60)
    if probe.returncode != 0:
        require_containers(f"podman does not work here: {probe.stderr.strip()[-300:]}")
    return env


@pytest.fixture(scope="session")
def image(podman_env, tmp_path_factory) -> str:
    env = podman_env
    if _run(["podman", "image", "exists", BASE], env, 30).returncode != 0:
        rootfs = tmp_path_factory.mktemp("base") / "rootfs.tar"
        _check(_run(["mmdebstrap", "--variant=apt", "--include=python3,python3-venv,ca-certificates",
                     "--customize-hook=chroot \"$1\" python3 -m venv /opt/venv", "bookworm", str(rootfs)], env, 300),
               "mmdebstrap")
        _check(_run(["podman", "import", "--change",
                     "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     "--change", 'CMD ["python"]', str(rootfs), BASE], env, 120), "podman import")
    wheels = PROJECT_ROOT / ".whl"  # in the build context, ignored by git
    _check(_run([sys.executable, "-m", "pip", "download", "--quiet", f"torch=={TORCH_VERSION}",
                 "-d", str(wheels)], env, 300), "pip download torch")
    volume = ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"] if Path(CA_BUNDLE).exists() else []
    _check(_run(["podman", "build", "-f", "docker/Dockerfile.cpu", "--build-arg", "TORCH_WHEELS=.whl",
                 f"--build-arg=TORCH_VERSION={TORCH_VERSION}", *volume, "-t", IMAGE, "."], env, 600,
                cwd=PROJECT_ROOT), "podman build")
    return IMAGE


def _in_image(env: dict, image: str, runs: Path, cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    runs.mkdir(parents=True, exist_ok=True)
    name = f"ps-test-{uuid.uuid4().hex[:8]}"
    try:
        return _run(["podman", "run", "--rm", "--name", name, "-v", f"{runs}:/app/runs", image, *cmd], env, timeout)
    finally:
        _run(["podman", "rm", "-f", "-t", "0", name], env, 60)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def image_single(podman_env, image, tmp_path_factory) -> dict:
    """The single-process run in the image: the reference for the runs in containers."""
    runs = tmp_path_factory.mktemp("image_single")
    proc = _in_image(podman_env, image, runs, ["python", "-m", "launch.train", *RUN, "parallel=single",
                                               "run.dir=/app/runs/single"])
    _check(proc, "the single-process run in the image")
    return _summary(runs / "single")


def _matches(summary: dict, single: dict) -> None:
    assert len(summary["losses"]) == len(single["losses"]) == 6
    diff = max_rel_diff(summary["losses"], single["losses"])
    assert diff < 1e-5, f"losses differ by {diff:.2e} relative\n{summary['losses']}\n{single['losses']}"


# The first test that asks for the image builds it (base image, torch's wheels, the build: about 2 minutes
# from nothing on an idle 2-core machine, 4 under load), inside its own timeout: give it room.
@pytest.mark.timeout(900)
def test_image_trains_two_processes_as_one(podman_env, image, image_single, tmp_path):
    proc = _in_image(podman_env, image, tmp_path, ["torchrun", "--standalone", "--nproc-per-node", "2",
                                                   "-m", "launch.train", *RUN, "parallel=dp", "run.dir=/app/runs/dp"])
    _check(proc, "torchrun in the image")
    summary = _summary(tmp_path / "dp")
    assert summary["world_size"] == 2 and summary["parallel"]["dp"] == 2
    _matches(summary, image_single)


@pytest.mark.timeout(900)
def test_compose_two_containers_as_two_nodes(podman_env, image, image_single, tmp_path):
    # compose.yaml's paths are relative to its folder (../runs/compose/nodeK): a copy in tmp_path/docker
    # puts each container's runs under tmp_path/runs/compose/.
    (tmp_path / "docker").mkdir()
    shutil.copy(PROJECT_ROOT / "docker" / "compose.yaml", tmp_path / "docker" / "compose.yaml")
    project = f"pstest{uuid.uuid4().hex[:6]}"
    compose = ["podman-compose", "-p", project, "-f", "docker/compose.yaml"]
    try:
        up = _run([*compose, "up", "--abort-on-container-exit"], podman_env, 240, cwd=tmp_path)
        codes = {}
        for node in ("node0", "node1"):
            inspect = _run(["podman", "inspect", "-f", "{{.State.ExitCode}}", f"{project}_{node}_1"], podman_env, 30)
            codes[node] = inspect.stdout.strip()
        # podman-compose 1.0's own exit status is not the containers' (it is 255 after a clean run).
        assert codes == {"node0": "0", "node1": "0"}, f"{codes}\n{up.stdout[-4000:]}\n{up.stderr[-2000:]}"
    finally:
        _run([*compose, "down", "-t", "0"], podman_env, 120, cwd=tmp_path)
    run_dirs = {n: sorted((tmp_path / "runs" / "compose" / n).iterdir()) for n in ("node0", "node1")}
    assert [len(d) for d in run_dirs.values()] == [1, 1], run_dirs
    with_summary = [d[0] for d in run_dirs.values() if (d[0] / "summary.json").exists()]
    assert len(with_summary) == 1, "exactly one summary.json, written by global rank 0"
    summary = _summary(with_summary[0])
    assert summary["world_size"] == 4 and summary["parallel"]["tp"] == 2 and summary["parallel"]["dp"] == 2
    logs = sorted(sorted(p.name for p in (d[0] / "logs").iterdir()) for d in run_dirs.values())
    assert logs == [["rank0.log", "rank1.log"], ["rank2.log", "rank3.log"]]  # two ranks in each container
    _matches(summary, image_single)
