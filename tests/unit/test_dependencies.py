"""Every import of plait is a declared dependency: the source's imports against pyproject.toml
here, and the installed wheel's against its metadata in `tests/e2e/test_installed_wheel.py`."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.dependency_imports import package_imports, problems

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def pyproject_requirements() -> list[str]:
    """pyproject's dependencies as metadata lines (`name; extra == "x"` for an extra's)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        lines += [f'{r.split(";")[0]}; extra == "{extra}"' for r in requirements]
    return lines


def test_every_import_is_a_declared_dependency() -> None:
    assert problems(ROOT, pyproject_requirements()) == []


def test_the_check_sees_what_it_must() -> None:
    """The rules bite: click, imported by the CLI at start-up, must be a base requirement."""
    imports = package_imports(ROOT)
    assert any(i.module == "plait.tools.cli" and i.top == "click" and i.eager for i in imports)
    assert any(i.top == "tomli" for i in imports)  # Python 3.10's TOML parser
    without_click = [r for r in pyproject_requirements() if not r.startswith("click")]
    assert any("imports click" in p for p in problems(ROOT, without_click))
    as_extra = [*without_click, 'click>=8.1; extra == "cli"']
    assert any("only the extra [cli]" in p for p in problems(ROOT, as_extra))
