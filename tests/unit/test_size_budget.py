"""The size budget: no source file over 400 lines, no function or method over 60.

Read with `ast` from every .py file under parallel/, launch/, bench/, lab/ and tests/. A
function's size is `end_lineno - lineno + 1`: from its `def` line to its last line, decorators
not counted (they sit above `lineno`). A nested function counts on its own and inside the
function that holds it. One test per file, so a failure names the file, each function past the
budget with its size, and the limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("parallel", "launch", "bench", "lab", "tests")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def source_files() -> list[Path]:
    return sorted(p for folder in FOLDERS if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*.py"))


def violations(source: str, name: str) -> list[str]:
    """Every way `source` breaks the budget, one line each, naming the size and the limit."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{name}: {lines} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {size} lines (limit {MAX_FUNCTION_LINES})")
    return found


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_within_budget(path: Path):
    broken = violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not broken, "over the size budget:\n" + "\n".join(broken)


def test_every_folder_is_read():
    read = {p.relative_to(ROOT).parts[0] for p in source_files()}
    assert {"parallel", "launch", "tests"} <= read


def body(lines: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


def test_a_long_function_is_named_with_its_size():
    source = "@decorator\ndef long():\n" + body(MAX_FUNCTION_LINES)
    assert violations(source, "synthetic.py") == [
        f"synthetic.py:2 long: {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"]


def test_a_long_method_is_named_and_a_short_one_is_not():
    source = ("class C:\n    def short(self):\n        pass\n\n    def long(self):\n"
              + body(MAX_FUNCTION_LINES).replace("    ", "        "))
    assert violations(source, "c.py") == [f"c.py:5 long: {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"]


def test_a_function_at_the_limit_passes():
    assert violations("def fits():\n" + body(MAX_FUNCTION_LINES - 1), "fits.py") == []


def test_a_long_file_is_named_with_its_size():
    source = "x = 0\n" * (MAX_FILE_LINES + 1)
    assert violations(source, "long.py") == [f"long.py: {MAX_FILE_LINES + 1} lines (limit {MAX_FILE_LINES})"]
