"""lab/ stays out of the product: no module of parallel/, launch/ or bench/ imports it."""

from __future__ import annotations

import ast

from launcher import PROJECT_ROOT


def imports_of(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_nothing_of_the_product_imports_the_lab():
    product = [p for top in ("parallel", "launch", "bench") for p in sorted((PROJECT_ROOT / top).rglob("*.py"))]
    assert len(product) > 100
    importing = [str(p.relative_to(PROJECT_ROOT)) for p in product
                 if any(m == "lab" or m.startswith("lab.") for m in imports_of(p))]
    assert importing == []
