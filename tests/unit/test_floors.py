"""The import graph against the floors of parallel/__init__.py: imports only go down.

Every `import` and `from ... import` of the project's own modules is read from the source with
`ast`, wherever it stands (a function's lazy import counts as much as one at the top). A module
may import its own floor and the floors below it. On the families' floor a package may not import
another family at all: what families share sits on a floor below them (parallel/sync/). No list of
tolerated violations: the test names every import that breaks a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import parallel
from parallel import FAMILY_FLOOR, FLOORS

ROOT = Path(parallel.__file__).resolve().parent.parent
FIRST_PARTY = ("parallel", "launch")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for top in FIRST_PARTY for p in sorted((ROOT / top).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that `name` imports: `from a.b import c` is a.b.c where that is a
    module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in FIRST_PARTY)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in FIRST_PARTY:
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
    found.discard(name)
    return found


def owner(module: str) -> tuple[int, str]:
    """(floor index, the prefix that holds the module)."""
    best = None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    return best


def floor_index(name: str) -> int:
    return next(i for i, (floor, _) in enumerate(FLOORS) if floor == name)


def test_every_module_has_a_floor():
    homeless = [m for m in project_modules() if m not in ("parallel", "launch") and owner(m) is None]
    assert not homeless, f"modules on no floor of parallel.FLOORS: {homeless}"


def violations(modules: dict[str, Path]) -> list[str]:
    known = set(modules)
    families = floor_index(FAMILY_FLOOR)
    bad = []
    for name, path in modules.items():
        if name in ("parallel", "launch"):
            continue
        if owner(name) is None:
            continue  # reported by test_every_module_has_a_floor
        here, home = owner(name)
        for target in sorted(imported_modules(name, path, known)):
            if target in ("parallel", "launch"):
                continue  # the package itself: the floors' declaration
            if owner(target) is None:
                continue
            there, target_home = owner(target)
            if there > here:
                bad.append(f"{name} (floor {FLOORS[here][0]}) imports {target} (floor {FLOORS[there][0]}, above)")
            elif here == there == families and home != target_home:
                bad.append(f"{name} imports {target}: a family never imports another family (what they "
                           "share sits on a floor below; where they meet is parallel/compose/)")
    return bad


def test_imports_only_go_down():
    bad = violations(project_modules())
    assert not bad, "imports against the floors of parallel/__init__.py:\n  " + "\n  ".join(bad)


def test_no_import_cycle():
    """No cycle among the project's modules (lazy imports included): each module's imports,
    followed depth first, never lead back to it."""
    modules = project_modules()
    known = set(modules)
    graph = {m: {t for t in imported_modules(m, p, known) if t in known} for m, p in modules.items()}
    # a package's __init__ is imported by its submodules implicitly; only written imports count here
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_checker_sees_a_violation(tmp_path):
    """The rules catch what they are for: a core module importing a family, and one family
    importing another, are both reported (so a passing test means something)."""
    modules = project_modules()
    fake = {
        "parallel.core.model": "from parallel.tp.layers import TPShards\n",
        "parallel.cp.transform": "def f():\n    from parallel.tp.regions import exit_region\n",
        "parallel.pp.executor": "from parallel.sync.shards import gather_full\n",
        "parallel.pp.split": "from parallel.zero.theory import zero_comm\n",
    }
    paths = {}
    for name, text in fake.items():
        p = tmp_path / (name.replace(".", "_") + ".py")
        p.write_text(text)
        paths[name] = p
    bad = violations({**modules, **paths})
    assert any(b.startswith("parallel.core.model (floor core) imports parallel.tp.layers") for b in bad)
    assert any(b.startswith("parallel.cp.transform imports parallel.tp.regions") for b in bad)
    assert any(b.startswith("parallel.pp.split imports parallel.zero.theory") for b in bad)
    assert not any(b.startswith("parallel.pp.executor imports") for b in bad)  # the syncs are a floor below


def test_what_runs_is_plain_code():
    """No table is read out of a docstring: the registry and the route table import under `python -OO`,
    which strips docstrings."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-OO", "-c", "import parallel.registry, parallel.compose.route"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_each_formula_is_written_once():
    """The recipe's per-stage traffic is the sum of the families' own terms (tp's per stage, cp's per
    block, the pipeline's per rank), called, never written out again: compose/theory.py calls each
    family's term and names none of the counts those terms are made of."""
    tree = ast.parse((ROOT / "parallel" / "compose" / "theory.py").read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"tp_stage_payloads", "cp_attention_traffic", "p2p_sent_by_rank"} <= called
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    # tp's own counts: tensors per layer, the sequence-sharded parameters, the regathered inputs
    assert not named & {"tp_tensors_per_layer", "sequence_sharded_parameter_count", "tp_regathers_per_microbatch"}
