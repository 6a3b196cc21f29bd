"""The Slurm script, the Docker files and the compose file, checked as far as this machine allows.

Without Slurm or a container engine (tests/tools/test_slurm.py and tests/tools/test_containers.py run them
where they are installed), what can be checked: the sbatch script is valid bash,
its #SBATCH lines are where Slurm reads them, and run with stand-ins for `scontrol` and `srun`
(which only report what they were given) it starts exactly the torchrun command line that
tests/tools/test_multinode.py runs for real; the compose file starts the same command line, with its
layout accepted by the run plan; the Dockerfiles copy files that exist, the CPU image pins the
torch that launch/setup.sh installs, and the CUDA image keeps its own torch.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from launcher import PROJECT_ROOT, multinode_command

from parallel.dist.groups import LaunchEnv
from parallel.run_plan import build_plan

SBATCH = PROJECT_ROOT / "launch" / "slurm" / "train.sbatch"
DOCKER = PROJECT_ROOT / "docker"


def test_sbatch_is_valid_bash_with_directives_before_the_first_command():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    lines = [line.strip() for line in SBATCH.read_text().splitlines()]
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    # Slurm stops reading #SBATCH lines at the first command.
    assert directives and max(directives) < first_command
    assert "#SBATCH --ntasks-per-node=1" in lines  # one torchrun agent per node
    assert "#SBATCH --requeue" in lines  # a requeued job runs the script again, same job id


def _sbatch_with_stand_ins(tmp_path, slurm_env: dict[str, str], overrides: list[str]):
    """train.sbatch run as the batch step of a 2-node job with 2 GPUs per node, with stand-ins for
    scontrol and srun: (the finished script, srun's arguments or None, srun's SLURM_CPUS_PER_GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/bin/sh\n'
                                      '[ "$1 $2 $3" = "show hostnames gpu[01-02]" ] && printf "gpu01\\ngpu02\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$SRUN_ARGS"\n'
                                  'printf "%s" "${SLURM_CPUS_PER_GPU-unset}" > "$SRUN_ARGS.cpus_per_gpu"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    args_file = tmp_path / "srun_args"
    args_file.unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "SRUN_ARGS": str(args_file), "PYTHON": sys.executable,
        "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(PROJECT_ROOT), **slurm_env,
    }
    done = subprocess.run(["bash", str(SBATCH), *overrides], env=env, capture_output=True, text=True, timeout=60)
    if not args_file.exists():
        return done, None, None
    return done, args_file.read_text().splitlines(), Path(f"{args_file}.cpus_per_gpu").read_text()


def test_sbatch_starts_the_multinode_torchrun_on_the_first_node(tmp_path):
    overrides = ["parallel=tp", "model=tiny", "train.steps=6"]
    done, args, cpus_per_gpu = _sbatch_with_stand_ins(tmp_path, {"SLURM_CPUS_PER_GPU": "4", "MAX_RESTARTS": "2"},
                                                      overrides)
    assert done.returncode == 0, done.stderr
    split = args.index(sys.executable)
    # The node's task gets its CPUs: 2 GPUs x --cpus-per-gpu=4; srun is not handed SLURM_CPUS_PER_GPU,
    # which it would read as a --cpus-per-gpu of its own beside --cpus-per-task (mutually exclusive).
    assert args[:split] == ["--ntasks-per-node=1", "--cpus-per-task=8", "--kill-on-bad-exit=1"]
    assert cpus_per_gpu == "unset"
    endpoint = next(a for a in args if a.startswith("--rdzv-endpoint=")).split("=", 1)[1]
    host, port = endpoint.rsplit(":", 1)
    assert host == "gpu01" and 1024 <= int(port) <= 65535
    # MAX_RESTARTS is each agent's --max-restarts; train.resume=auto is added (a requeued job resumes).
    expected = multinode_command(2, 2, endpoint, "4242", [*overrides, "train.resume=auto"], python=sys.executable)
    nproc = expected.index("--nproc-per-node=2")
    assert args[split:] == [*expected[:nproc + 1], "--max-restarts=2", *expected[nproc + 1:]]


@pytest.mark.parametrize("slurm_env,cpus", [
    ({"SLURM_CPUS_PER_TASK": "12", "SLURM_CPUS_ON_NODE": "12"}, 12),  # --cpus-per-task: the node's task's
    ({"SLURM_CPUS_ON_NODE": "16"}, 16),  # nothing asked: what the cluster gave (DefCpuPerGPU, whole nodes)
    ({"SLURM_CPUS_PER_GPU": "3", "SLURM_CPUS_ON_NODE": "64"}, 6),  # --cpus-per-gpu: 3 for each of 2 GPUs
], ids=["cpus-per-task", "cluster-default", "cpus-per-gpu"])
def test_the_gpu_ranks_get_the_cpus_the_job_holds(tmp_path, slurm_env, cpus):
    done, args, _ = _sbatch_with_stand_ins(tmp_path, slurm_env, ["parallel=dp", "model=tiny"])
    assert done.returncode == 0, done.stderr
    assert args[:3] == ["--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1"]
    assert f"2 GPUs per node, one process each, {cpus} CPUs" in done.stdout


@pytest.mark.parametrize("per_gpu", [None, "8"])
def test_gpu_ranks_without_a_cpu_each_are_refused_in_one_line(tmp_path, per_gpu):
    """Eight ranks and torchrun on the one CPU a job gets by default on many clusters: refused, with
    the --cpus-per-gpu to ask for (CPUS_PER_GPU, 4 unless set)."""
    slurm_env = {"SLURM_CPUS_ON_NODE": "1", **({"CPUS_PER_GPU": per_gpu} if per_gpu else {})}
    done, args, _ = _sbatch_with_stand_ins(tmp_path, slurm_env, ["parallel=dp", "model=tiny"])
    assert done.returncode == 2 and args is None  # nothing was started
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: 2 GPUs per node but 1 CPU(s) on the node for their 2 ranks and torchrun: ask for "
                      f"CPUs per GPU, e.g. sbatch --gpus-per-node=2 --cpus-per-gpu={per_gpu or 4}"]


def _compose():
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_runs_the_multinode_command_between_two_containers():
    services = _compose()["services"]
    assert sorted(services) == ["node0", "node1"]
    commands = [services[name]["command"] for name in ("node0", "node1")]
    assert commands[0] == commands[1], "every node runs the same torchrun command"
    cmd = commands[0]
    overrides = cmd[cmd.index("launch.train") + 1:]
    assert cmd == multinode_command(2, 2, "node0:29400", "compose-job", overrides, python="python")
    # The rendezvous host is a service whose own host name it is (so its agent serves the store).
    assert services["node0"]["hostname"] == "node0"
    for _name, service in services.items():
        # As in the loopback test (GLOO_SOCKET_IFNAME=lo), gloo is told its interface.
        assert service["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert (PROJECT_ROOT / service["build"]["dockerfile"]).name == "Dockerfile.cpu"
    # The job's layout is one the plan accepts at world 4 on 2 processes per node, with each
    # tensor-parallel group inside one container.
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    plan = build_plan(cfg, LaunchEnv(rank=0, world_size=4, local_rank=0, local_world_size=2), cuda_available=False)
    assert plan.dims.node_layout_warning(2) is None


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined."""
    text = (DOCKER / dockerfile).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _check_copies_exist(instructions):
    ignored = {line.strip() for line in (PROJECT_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for op, args in instructions:
        if op == "COPY":
            *sources, _dest = shlex.split(args)
            for source in sources:
                assert (PROJECT_ROOT / source).exists(), f"COPY {source}: not in the build context"
                assert source.rstrip("/") not in ignored, f"COPY {source}: excluded by .dockerignore"


def test_cpu_image_pins_the_torch_of_setup_sh():
    instructions = _instructions("Dockerfile.cpu")
    assert instructions[0] == ("FROM", "python:3.11-slim")
    args = dict(a.split("=", 1) for op, a in instructions if op == "ARG")
    setup_pin = re.search(r"spec=\$\{TORCH_SPEC:-torch==([\d.]+)\}", (PROJECT_ROOT / "launch" / "setup.sh").read_text())
    assert setup_pin and args["TORCH_VERSION"] == setup_pin.group(1)
    runs = [a for op, a in instructions if op == "RUN"]
    # torch's source is a build argument: PyTorch's CPU index by default, a wheel directory offline.
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert any('--index-url "${TORCH_INDEX_URL}"' in r and '"torch==${TORCH_VERSION}"' in r for r in runs)
    assert any('--no-index --find-links "/context/${TORCH_WHEELS}"' in r for r in runs)
    assert ("CMD", '["python", "-m", "launch.compare"]') in instructions
    _check_copies_exist(instructions)


def test_cuda_image_keeps_the_torch_of_its_pytorch_base():
    instructions = _instructions("Dockerfile.cuda")
    base = dict(a.split("=", 1) for op, a in instructions if op == "ARG")["BASE"]
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", base)
    assert ("FROM", "${BASE}") in instructions
    runs = " ".join(a for op, a in instructions if op == "RUN")
    assert "pip install torch" not in runs and "-c /tmp/torch-constraint.txt" in runs
    _check_copies_exist(instructions)


def test_every_code_directory_is_an_installed_package():
    """`pip install .` ships the packages setup.py finds: a folder of modules without __init__.py
    is left out, and the installed tools fail on import (ModuleNotFoundError) far from here."""
    from setuptools import find_packages

    found = set(find_packages(where=str(PROJECT_ROOT), include=["parallel", "parallel.*", "launch", "launch.*"]))
    with_code = {str(d.relative_to(PROJECT_ROOT)).replace("/", ".")
                 for top in ("parallel", "launch") for d in [PROJECT_ROOT / top, *(PROJECT_ROOT / top).rglob("*")]
                 if d.is_dir() and any(d.glob("*.py"))}
    assert with_code <= found, f"not packages (add an __init__.py): {sorted(with_code - found)}"


# -- lint: what can be checked of a Dockerfile without building it -----------------------------------

def _lint_steps(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_lint(dockerfile):
    """What can be checked of a Dockerfile without building it (Dockerfile.cuda is never built here)."""
    steps = _lint_steps(PROJECT_ROOT / "docker" / dockerfile)
    assert steps[0][0] in ("FROM", "ARG") and any(w == "FROM" for w, _ in steps)
    copied = []
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            copied += sources
    for source in copied:
        assert (PROJECT_ROOT / source).exists(), f"{dockerfile}: COPY {source}: no such file in the build context"
    # setup.py names the packages; without it pip stops at "Multiple top-level packages discovered".
    assert {"pyproject.toml", "setup.py", "README.md"} <= set(copied)
    # Every directory the package needs is copied (setup.py's packages and the Hydra configs).
    assert {"parallel/", "launch/", "conf/"} <= set(copied)
    # Every ${VAR} used is an ARG or ENV declared before the use.
    declared = set()
    for word, rest in steps:
        if word == "RUN" or word == "FROM":
            for var in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", rest):
                assert var in declared, f"{dockerfile}: ${var} used in {word} before an ARG/ENV declares it"
        if word == "ARG":
            declared.add(rest.split("=")[0])
        if word == "ENV":
            declared.update(k for k in re.findall(r"([A-Z_][A-Z0-9_]*)=", rest))
    # Nothing the build needs is excluded from the context by .dockerignore.
    ignored = [p.strip() for p in (PROJECT_ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for source in copied:
        assert source.rstrip("/") not in ignored, f"{source} is copied but .dockerignore excludes it"
