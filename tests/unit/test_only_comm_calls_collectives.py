"""Only parallel/dist/comm.py calls torch.distributed's collectives and point-to-point ops.

Every byte a run sends must reach its communication log (parallel/dist/commlog.py), so every
collective or message goes through a `Communicator`, which records it; traffic the tools add is
tagged under `TOOLING_PREFIX` and kept out of the strategy's figures. A direct call elsewhere
sends bytes no log sees (the loopback probe once sent most of a run's bytes that way).

Read with `ast` from every .py file under parallel/, launch/ and bench/. A violation is a call of
one of torch.distributed's collective or p2p functions (`COLLECTIVE_NAMES`, and any name with
`_object` in it), reached through the module however it was imported (`import torch.distributed
as dist`, `import torch`, `from torch import distributed`, a submodule such as
`torch.distributed.distributed_c10d`), or imported by name from it; called, or handed to a call
(`partial(dist.all_reduce, t)`, `P2POp(dist.isend, ...)`), which calls it later. A reference
that is neither (`p.op is dist.isend`, reading which op torch posted) is not a violation.

lab/ is exempt: its scripts are investigations of the host and of gloo itself (what one gloo call
costs, what a collective puts on the wire), which must call torch.distributed bare to measure it;
they are never part of a run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("parallel", "launch", "bench")
THE_ONE_MODULE = "parallel/dist/comm.py"
COLLECTIVE_NAMES = {"all_reduce", "broadcast", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
                    "reduce", "monitored_barrier"}
COLLECTIVE_PREFIXES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
DIST = "torch.distributed"


def is_collective(name: str) -> bool:
    return name in COLLECTIVE_NAMES or name.startswith(COLLECTIVE_PREFIXES) or "_object" in name


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a Name/Attribute chain, or None for anything else (a call's result, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def aliases(tree: ast.Module) -> dict[str, str]:
    """Every local name bound by an import to a module or function, with its full dotted path."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import torch.distributed` binds `torch`; `import torch.distributed as dist` binds dist.
                bound[a.asname] = a.name if a.asname else None
                if not a.asname:
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return {k: v for k, v in bound.items() if k and v}


def resolved(name: str, bound: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    full = bound.get(head, head)
    return f"{full}.{rest}" if rest else full


def violations(source: str, name: str) -> list[str]:
    """Every call of a torch.distributed collective or p2p op in `source`, one line each."""
    tree = ast.parse(source, name)
    bound = aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for used, how in ((node.func, "calls"), *((arg, "hands on") for arg in node.args)):
            full = resolved(dotted(used), bound) if dotted(used) else ""
            module, _, function = full.rpartition(".")
            if (module == DIST or module.startswith(DIST + ".")) and is_collective(function):
                found.append(f"{name}:{node.lineno} {how} {full}")
    return found


def source_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
                  if p.relative_to(ROOT).as_posix() != THE_ONE_MODULE)


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_collective_outside_comm(path: Path):
    found = violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, ("torch.distributed called outside parallel/dist/comm.py (go through a Communicator; "
                       "tag tooling traffic under TOOLING_PREFIX):\n" + "\n".join(found))


def test_comm_itself_is_found_by_the_scan():
    """The scan finds the calls in the one module allowed to make them: it can fail."""
    found = violations((ROOT / THE_ONE_MODULE).read_text(), THE_ONE_MODULE)
    assert any("torch.distributed.all_reduce" in f for f in found)
    assert any("torch.distributed.batch_isend_irecv" in f for f in found)
    assert any("torch.distributed.gather_object" in f for f in found)


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndist.all_reduce(t)\n",
    "import torch\ntorch.distributed.barrier()\n",
    "import torch.distributed\ntorch.distributed.send(t, 1)\n",
    "from torch import distributed as d\nd.all_gather_into_tensor(o, t)\n",
    "from torch.distributed import broadcast_object_list as b\nb([x])\n",
    "import torch.distributed.distributed_c10d as c10d\nc10d.reduce_scatter_tensor(o, t)\n",
    "def f():\n    import torch.distributed as dist\n    dist.irecv(t, 0)\n",
    "from functools import partial\nimport torch.distributed as dist\npartial(dist.gather, t)\n",
    "import torch.distributed as dist\nops = [dist.P2POp(dist.isend, t, 1)]\n",
])
def test_each_way_of_reaching_a_collective_is_found(source: str):
    assert violations(source, "synthetic.py")


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\nok = p.op is dist.isend\n",
    "import torch.distributed as dist\ndist.get_rank()\ndist.new_group([0, 1])\n",
    "comm.all_reduce(t, tag='grads')\n",
])
def test_what_is_not_a_collective_call_passes(source: str):
    assert violations(source, "synthetic.py") == []
