"""The dependency rule of DESIGN.md: plugins depend on `plait.core`, never on each other, and the
core imports no plugin. Every import of every module under `core/` and `plugins/` counts —
inside functions and `TYPE_CHECKING` blocks too — as parsed by `ast`, without importing anything.
(The core's table of built-in plugins names their modules as strings, which is how the plugin
manager finds them; that is registration, not a dependency.)"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the folder `plait.*` is mapped from

# "file -> imported plugin package" pairs still to remove, each with the reason it is here.
# Empty: nothing is exempt.
ALLOWED: dict[str, set[str]] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["plait", *parts])


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, names of `from x import y`
    included as `x.y` (they may be submodules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def plugin_package(module: str) -> str | None:
    """`x` for `plait.plugins.x[.…]`; `""` for `plait.plugins` itself; None otherwise."""
    parts = module.split(".")
    if parts[:2] != ["plait", "plugins"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def violations() -> list[str]:
    found: list[str] = []
    for folder in ("core", "plugins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            own = path.relative_to(ROOT).parts[1] if folder == "plugins" else None
            for line, module in imported_modules(path):
                target = plugin_package(module)
                if target is None or target == own or target == "":
                    continue
                if target in ALLOWED.get(relative, set()):
                    continue
                who = "the core" if own is None else f"plugin {own!r}"
                found.append(f"{relative}:{line}: {who} imports {module}")
    return sorted(set(found))


def test_core_imports_no_plugin_and_plugins_import_no_other_plugin() -> None:
    assert violations() == []


def test_allow_list_has_no_stale_entries() -> None:
    for relative, targets in ALLOWED.items():
        path = ROOT / relative
        assert path.is_file(), f"{relative} is allow-listed but does not exist"
        imported = {plugin_package(m) for _, m in imported_modules(path)}
        assert targets <= imported, f"{relative} no longer imports {targets - imported}"


@pytest.mark.parametrize(
    ("source", "where", "expected"),
    [
        ("import plait.plugins.zero.stage3", "core/x.py", "plait.plugins.zero.stage3"),
        ("def f():\n    from plait.plugins import zero", "core/x.py", "plait.plugins.zero"),
        ("from ..zero import layout", "plugins/checkpoint/x.py", "plait.plugins.zero.layout"),
        ("from . import layout", "plugins/zero/__init__.py", "plait.plugins.zero.layout"),
    ],
)
def test_imports_are_found_wherever_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, where: str, expected: str
) -> None:
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source + "\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert expected in {module for _, module in imported_modules(path)}
    if where.startswith("core/") or "checkpoint" in where:
        assert violations(), "a forbidden import went unnoticed"


# The rank-side OpenTelemetry SDK and its OTLP exporters: only the telemetry plugin (and the
# daemon's optional upstream, built when one is configured) may load them.
RANK_SIDE_SDK = ("opentelemetry.sdk", "opentelemetry.exporter")

# Imports every daemon module and the daemon CLI, runs a daemon and queries it the way
# `plait status` and `plait top --once` do, then prints the SDK modules that got loaded.
DAEMON_PROBE = """
import importlib, json, pkgutil, sys
import plait.daemon
for module in pkgutil.walk_packages(plait.daemon.__path__, "plait.daemon."):
    importlib.import_module(module.name)
for name in ("plait.tools.daemon_commands", "plait.tools.daemon_client", "plait.core.daemon_auth",
             "plait.core.daemon_address", "plait.core.telemetry_resource"):
    importlib.import_module(name)
from typer.testing import CliRunner
from plait.daemon.server import DaemonServer
from plait.tools.cli import app
with DaemonServer("127.0.0.1:0", host_interval=60.0) as server:
    for command in (["status", "--json"], ["top", "--once"]):
        result = CliRunner().invoke(app, [*command, "--host", server.address])
        assert result.exit_code == 0, (command, result.output)
print(json.dumps(sorted(m for m in sys.modules if m.startswith(%r))))
"""


def loaded_by(probe: str) -> list[str]:
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_daemon_and_its_cli_never_load_the_rank_side_sdk() -> None:
    loaded = loaded_by(DAEMON_PROBE % (RANK_SIDE_SDK,))
    assert loaded == [], f"the daemon or plait status/top imported {loaded[:5]}…"


def test_the_probe_sees_the_sdk_when_something_loads_it() -> None:
    """The probe above would notice: the telemetry plugin does load the SDK."""
    probe = "import json, sys\nimport plait.plugins.telemetry\n"
    probe += f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({RANK_SIDE_SDK!r}))))"
    assert "opentelemetry.sdk.metrics" in loaded_by(probe)


def test_no_core_module_imports_the_opentelemetry_sdk() -> None:
    """`plait.core` stays importable without the SDK: its telemetry pieces (schema, resource,
    daemon address and auth) are plain Python and gRPC; the SDK parts live in the plugin."""
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: {module}"
        for path in sorted((ROOT / "core").rglob("*.py"))
        for line, module in imported_modules(path)
        if module.startswith(RANK_SIDE_SDK)
    ]
    assert found == []
