"""What runs around a step reaches the engine through its public seams only: no plugin, command
or integration reads a private member of an engine (`engine._job_info()`) or appends to its
runtimes behind its back (`engine.runtimes.append`): `Engine.job_info()` and
`Engine.append_runtime()` say what they are. Checked on the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE_THE_CORE = ("plugins", "tools", "training", "integrations", "planner", "daemon")


def reaches_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each `<engine>._private` read and `<x>.runtimes.append(...)` call."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, (ast.Name, ast.Attribute))
            and (node.value.id if isinstance(node.value, ast.Name) else node.value.attr) == "engine"
        ):
            found.append((node.lineno, f"engine.{node.attr}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "append"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "runtimes"
        ):
            found.append((node.lineno, "runtimes.append"))
    return found


def test_nothing_outside_the_core_reaches_into_an_engine() -> None:
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: {text}"
        for folder in OUTSIDE_THE_CORE
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, text in reaches_in(ast.parse(path.read_text()))
    ]
    assert found == []


def test_the_check_sees_both_ways_in() -> None:
    source = "def f(engine, g):\n    engine._job_info()\n    g.engine.runtimes.append(1)\n"
    found = sorted(reaches_in(ast.parse(source)))
    assert found == [(2, "engine._job_info"), (3, "runtimes.append")]
