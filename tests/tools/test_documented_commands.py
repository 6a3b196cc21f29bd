"""Every command the README and docs/ show works as written.

* The README's command blocks are run for real, as a newcomer would paste them, with tiny settings
  appended where the documented run would take minutes (the tiny model, 2-3 steps; the sweep over
  two strategies): a documented command cannot fail.
* Every other `launch.train`, `launch.compare`, `launch.run` and `launch.plan` command in docs/ is
  parsed exactly as the shell and Hydra would (quotes, lists, overrides) and validated for the
  world it launches, by the same code the tools run before anything starts (build_plan, the
  network's settings, the planner's config), without training.

`bash launch/setup.sh` and the test command itself are what CI (.ci/run) runs; they are not
re-run from inside the suite.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launcher import CPU_ONLY, GIVEN_LOOPBACK, PROJECT_ROOT
from net_launcher import require_network

from launch.config import CONFIG_DIR, unknown_preset
from parallel.dist.groups import LaunchEnv
from parallel.run_plan import build_plan

BLOCK = re.compile(r"```(?:bash|sh|console)?\n(.*?)```", re.S)
TOOLS = {"launch.train": "config", "launch.compare": "compare", "launch.run": "run", "launch.plan": "plan"}
SCRIPTS = {"parallel-train": "launch.train", "parallel-compare": "launch.compare", "parallel-run": "launch.run",
           "parallel-plan": "launch.plan"}
TINY_TRAIN = ["model=tiny", "train.steps=3", "train.warmup_steps=1", "data.max_bytes=1000000", "train.peak_flops=1e11",
              "run.timeline=false", *GIVEN_LOOPBACK]


PROGRAMS = ("python", ".venv/bin/", "torchrun", "parallel-", "bash", "source")
ASSIGNMENT = re.compile(r'^([A-Z_]+)="([^"]*)"$')
FOR_LOOP = re.compile(r"^for (\w+) in (\S+)")


def command_lines(path: Path) -> list[tuple[str, str | None]]:
    """The shell commands of a markdown file's code blocks, with the `error:` line a block shows
    right after a command (an example of a refusal), or None. Only lines that start with a program
    count (not the tables and trees some blocks hold); continuation lines are joined, comments and
    prompts dropped, `&&` chains split, and a block's shell variables (`COMMON="..."`, a `for`
    loop's variable, at its first value) expanded as the shell would."""
    found: list[tuple[str, str | None]] = []
    for block in BLOCK.findall(path.read_text()):
        variables: dict[str, str] = {}
        for raw in block.replace("\\\n", " ").splitlines():
            line = raw.strip().removeprefix("$ ")
            if line.startswith("error:") and found and found[-1][1] is None:
                found[-1] = (found[-1][0], line.removeprefix("error:").strip())
                continue
            line = re.sub(r"\s+#.*$", "", line) if not line.startswith("#") else ""
            if m := ASSIGNMENT.match(line):
                variables[m.group(1)] = m.group(2)
            elif m := FOR_LOOP.match(line):
                variables[m.group(1)] = m.group(2)
            for name, value in variables.items():
                line = line.replace("${" + name + "}", value).replace("$" + name, value)
            found += [(part.strip(), None) for part in line.split("&&") if part.strip().startswith(PROGRAMS)]
    return found


class Command:
    """One documented command line, understood: which tool, which world, which overrides."""

    def __init__(self, line: str, refused_with: str | None = None):
        self.line, self.refused_with = line, refused_with
        argv = shlex.split(line)
        self.world, self.tool, self.overrides = 1, None, []
        nnodes = 1
        for i, arg in enumerate(argv):
            if arg.startswith("--nproc-per-node"):
                self.world = int(arg.split("=")[1] if "=" in arg else argv[i + 1])
            elif arg.startswith("--nnodes"):
                nnodes = int((arg.split("=")[1] if "=" in arg else argv[i + 1]).split(":")[-1])
            elif arg == "-m" and i + 1 < len(argv) and argv[i + 1] in TOOLS:
                self.tool, self.overrides = argv[i + 1], argv[i + 2:]
                break
            elif Path(arg).name in SCRIPTS:
                self.tool, self.overrides = SCRIPTS[Path(arg).name], argv[i + 1:]
                break
        self.world *= nnodes
        self.overrides = [o for o in self.overrides if not o.startswith("--")]

    @property
    def documented(self) -> bool:
        """A command of ours, written out in full (not `...`, not a `<placeholder>`)."""
        return self.tool is not None and "..." not in self.line and "<" not in self.line


def documented_commands() -> list[tuple[str, Command]]:
    found = []
    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").rglob("*.md"))]:
        for line, refused_with in command_lines(path):
            command = Command(line, refused_with)
            if command.documented:
                found.append((str(path.relative_to(PROJECT_ROOT)), command))
    return found


def validate(command: Command) -> None:
    """What the tool checks before anything starts, for the world the command launches."""
    unknown = unknown_preset(command.overrides)
    assert unknown is None, unknown
    # A checkpoint that an earlier command of the same block writes (`train.resume=runs/...`) does not
    # exist yet here: that one override is left out, the rest is checked.
    overrides = [o for o in command.overrides
                 if not (o.startswith("train.resume=") and not (PROJECT_ROOT / o.split("=", 1)[1]).exists())]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=TOOLS[command.tool], overrides=overrides)
    if command.tool == "launch.train":
        build_plan(cfg, LaunchEnv(world_size=command.world, local_world_size=command.world),
                   cuda_available="nccl" in command.line or "bf16" in command.line)
    elif command.tool == "launch.run":
        from parallel.net.topology import NetSpec

        spec = NetSpec.from_config(cfg.net)
        build_plan(cfg, LaunchEnv(world_size=spec.world_size, local_world_size=spec.procs_per_node),
                   cuda_available=False)
    elif command.tool == "launch.compare":
        for name in cfg.compare.strategies:
            assert (Path(CONFIG_DIR) / "parallel" / f"{name}.yaml").is_file(), f"no preset for {name}"


DOCS = documented_commands()


@pytest.mark.parametrize("where,command", DOCS, ids=[f"{w}: {c.line[:60]}" for w, c in DOCS])
def test_documented_command_is_valid(where, command):
    if command.refused_with is None:
        validate(command)
        return
    # The docs show this command refused, with its line: that is what happens.
    with pytest.raises(ValueError) as refused:
        validate(command)
    assert str(refused.value) == command.refused_with


def test_the_docs_show_every_tool():
    tools = {c.tool for _, c in DOCS}
    assert tools == set(TOOLS), tools
    assert len(DOCS) >= 40


README_RUNS = [c for w, c in DOCS if w == "README.md"]


def _runnable(command: Command) -> list[str]:
    """The README's command with tiny settings appended where the documented run would be long."""
    argv = shlex.split(command.line)
    argv = [sys.executable if a in (".venv/bin/python", "python") else a for a in argv]
    argv = [a for a in argv if a != "source"]
    if argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if command.tool == "launch.plan":
        return argv  # the planner predicts; it trains nothing unless plan.validate=true
    # A documented model keeps its block's shape at the tiny size (small_llama -> tiny_llama), given once:
    # Hydra refuses a config group chosen twice.
    documented = next((a.split("=", 1)[1] for a in argv if a.startswith("model=")), "small")
    model = f"model={documented.replace('small', 'tiny') if documented.startswith('small') else 'tiny'}"
    argv = [a for a in argv if not a.startswith("model=")]
    if command.tool == "launch.compare":
        tiny = [model, "train.steps=3", "compare.strategies=[single,dp]", "compare.peak_flops=1e11"]
        nets = next((o for o in command.overrides if o.startswith("compare.nets=")), None)
        if nets is not None:
            # The sweep's world follows each network: networks of world 2 instead of the documented ones.
            # A list with a preset changed in place ({preset:..., inter_mbit:...}) runs that form alone:
            # the loopback and ethernet_1g sweep of the other command is not run twice.
            if "{" in nets:
                return [*argv, *tiny, *GIVEN_LOOPBACK, "compare.nets=[{preset:ethernet_1g,inter_mbit:200,label:slow}]"]
            return [*argv, *tiny, *GIVEN_LOOPBACK, "compare.nets=[none,ethernet_1g]"]
        # Every sweep here is given the loopback's figures: test_compare.py's sweep is the one that
        # probes (about 12 s of three probes), and asserts that it did.
        return [*argv, *tiny, *GIVEN_LOOPBACK, "compare.world=2"]
    return [*argv, model, *TINY_TRAIN[1:]]


def _on_a_network(command: Command) -> bool:
    return any(o.startswith(("net=", "compare.nets=")) and not o.endswith("=none") for o in command.overrides)


PRODUCES = {"launch.compare": "results.csv", "launch.plan": "plan.json"}


@pytest.mark.parametrize("command", README_RUNS, ids=[c.line[:70] for c in README_RUNS])
def test_readme_command_runs(command, tmp_path):
    if _on_a_network(command):
        require_network()
    argv = _runnable(command) + [f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(argv, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "run" / PRODUCES.get(command.tool, "summary.json")).is_file()
