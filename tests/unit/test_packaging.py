"""Packaging: folders map into `plait.*`, nothing named `core` or `plugins` is importable."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.wheel_build import build_wheel

ROOT = Path(__file__).resolve().parents[2]


def test_no_top_level_core_or_plugins_module(tmp_path: Path) -> None:
    code = (
        "import importlib.util as u, plait.core.engine, plait.plugins.ddp, plait.daemon, "
        "plait.proto, plait.tools.cli\n"
        "print([n for n in ('core', 'plugins', 'daemon', 'proto', 'tools') if u.find_spec(n)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(240)
def test_wheel_holds_every_package_and_its_data(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"plait", wheel.name.split("-py")[0] + ".dist-info"}
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    # Every top-level package folder of the checkout (planner included) is in the wheel.
    folders = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert {"core", "plugins", "proto", "daemon", "tools", "planner"} <= set(folders)
    for folder in folders:
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                rel = init.parent.relative_to(ROOT).as_posix()
                assert f"plait/{rel}" in packages, f"{rel} missing from the wheel"
    assert "plait/plugins/data/corpus/python_docs.txt" in names
    assert "plait/proto/plait/v1/daemon.proto" in names
    # The example configs ship as data (`plait demo`, `plait init`).
    configs = sorted(p.name for p in (ROOT / "configs").glob("*.toml"))
    assert configs and all(f"plait/configs/{name}" in names for name in configs)
    assert "plait/setup.py" not in names and "plait/pyproject.toml" not in names
