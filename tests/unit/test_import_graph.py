"""The dependency rules of DESIGN.md, checked on the source as parsed by `ast`, without importing
anything.

- Plugins depend on `plait.core`, never on each other, and the core imports no plugin. Every
  import of every module under `core/` and `plugins/` counts — inside functions and
  `TYPE_CHECKING` blocks too. (The core's table of built-in plugins names their modules as
  strings, which is how the plugin manager finds them; that is registration, not a dependency.)
- No run-time import loop inside a folder of plait (`core/`, `daemon/`, `planner/`, `tools/`, …,
  each plugin's folder, the top folder's own files): two modules that import each other, however
  indirectly, can be neither read nor tested alone, and the one imported first sees the other
  half-built. Imports inside functions count (they run); imports under `if TYPE_CHECKING:` do not
  (they never run), which is how a type hint may point back.
"""

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


def is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING` (or any `x.TYPE_CHECKING`)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def import_nodes(tree: ast.AST, *, runtime_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`, at any depth; with `runtime_only`, not those in the
    body of an `if TYPE_CHECKING:` (its `else:` runs)."""
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif runtime_only and isinstance(node, ast.If) and is_type_checking(node.test):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def import_targets(path: Path, *, runtime_only: bool = False) -> Iterator[tuple[int, list[str]]]:
    """(line, names) per imported thing in `path`: `[x]` for `import x`, `[x.y, x]` for
    `from x import y` (`y` may be a submodule, or a name defined in `x`). Relative imports are
    made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in import_nodes(tree, runtime_only=runtime_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, [alias.name]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            yield node.lineno, [f"{base}.{alias.name}", base]


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, `TYPE_CHECKING` ones included;
    names of `from x import y` included as `x.y` (they may be submodules)."""
    for line, names in import_targets(path):
        yield from ((line, name) for name in names)


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


# -- run-time import loops ----------------------------------------------------------------------

# Folders whose files are not modules of plait.
NOT_PLAIT = {"tests", "build", "dist", "__pycache__"}


def plait_modules() -> dict[str, Path]:
    """Every module of plait by name (`plait.daemon.otlp` -> daemon/otlp.py)."""
    modules: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if any(p in NOT_PLAIT or p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        modules[module_name(path)] = path
    return modules


def folder_of(path: Path) -> str:
    """The folder a module belongs to for the loop rule: `plugins/<name>` for a plugin's
    modules, the top folder for the others (`core`, `daemon`, …), "" for the top's own files."""
    parts = path.relative_to(ROOT).parts
    if parts[0] == "plugins" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0] if len(parts) > 1 else ""


def runtime_imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module of plait it imports when its code runs: the first line doing so}.

    `from pkg import sub` imports the submodule `sub` (not `pkg`'s own code, which Python runs
    first for any submodule); `from pkg import name` imports `pkg`."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, candidates in import_targets(path, runtime_only=True):
            target = next((c for c in candidates if c in modules), None)
            if target is not None and target != name:
                edges.setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each holds at least one loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def shortest_loop(graph: dict[str, dict[str, int]], start: str) -> list[str]:
    """The shortest chain of imports from `start` back to itself (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(came_from[chain[-1]])
                    return [start, *reversed(chain[:-1]), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is on no loop")


def import_loops() -> list[str]:
    """Each run-time import loop inside a folder, named by its files in import order, with
    the line of each import: `daemon/a.py → daemon/b.py → daemon/a.py (a.py:3, b.py:9)`."""
    modules = plait_modules()
    graph = runtime_imports(modules)
    described: list[str] = []
    for folder in sorted({folder_of(path) for path in modules.values()}):
        inside = {name for name, path in modules.items() if folder_of(path) == folder}
        subgraph = {
            name: {t: line for t, line in graph[name].items() if t in inside} for name in inside
        }
        for component in strongly_connected(subgraph):
            loop = shortest_loop(subgraph, component[0])
            files = [modules[name].relative_to(ROOT).as_posix() for name in loop]
            lines = [f"{files[i]}:{subgraph[loop[i]][loop[i + 1]]}" for i in range(len(loop) - 1)]
            described.append(f"{' → '.join(files)} (imports at {', '.join(lines)})")
    return described


def test_no_run_time_import_loop_inside_a_folder() -> None:
    loops = import_loops()
    assert loops == [], "run-time import loops:\n  " + "\n  ".join(loops)


LOOP_CASES = {
    "a loop through an import inside a function": (
        {
            "daemon/receiver.py": "from plait.daemon.pool import Pool\n",
            "daemon/pool.py": "def work():\n    from plait.daemon.receiver import parse\n",
        },
        [
            "daemon/pool.py → daemon/receiver.py → daemon/pool.py (imports at daemon/pool.py:2, "
            "daemon/receiver.py:1)"
        ],
    ),
    "a longer loop through relative imports": (
        {
            "core/a.py": "from . import b\n",
            "core/b.py": "from .c import thing\n",
            "core/c.py": "import plait.core.a\n",
        },
        [
            "core/a.py → core/b.py → core/c.py → core/a.py (imports at core/a.py:1, core/b.py:1, "
            "core/c.py:1)"
        ],
    ),
    "a package and a module importing a name from it": (
        {
            "plugins/x/__init__.py": "from plait.plugins.x.impl import run\n",
            "plugins/x/impl.py": "from plait.plugins.x import DEFAULTS\n",
        },
        [
            "plugins/x/__init__.py → plugins/x/impl.py → plugins/x/__init__.py (imports at "
            "plugins/x/__init__.py:1, plugins/x/impl.py:1)"
        ],
    ),
    "a type-hint import back is no loop": (
        {
            "core/a.py": "from plait.core.b import B\n",
            "core/b.py": "import typing\n"
            "if typing.TYPE_CHECKING:\n    from plait.core.a import A\n",
        },
        [],
    ),
    "the else of TYPE_CHECKING runs": (
        {
            "core/a.py": "from plait.core.b import B\n",
            "core/b.py": "if TYPE_CHECKING:\n    pass\nelse:\n    from plait.core.a import A\n",
        },
        ["core/a.py → core/b.py → core/a.py (imports at core/a.py:1, core/b.py:4)"],
    ),
    "importing a sibling submodule does not import the package back": (
        {
            "plugins/x/__init__.py": "from plait.plugins.x.impl import run\n",
            "plugins/x/impl.py": "from plait.plugins.x import helpers\n",
            "plugins/x/helpers.py": "VALUE = 1\n",
        },
        [],
    ),
}


@pytest.mark.parametrize(("files", "expected"), LOOP_CASES.values(), ids=LOOP_CASES.keys())
def test_loops_are_found_and_named(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    files: dict[str, str],
    expected: list[str],
) -> None:
    for relative, source in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert import_loops() == expected


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
for name in ("plait.tools.daemon_commands", "plait.tools.daemon_client", "plait.daemon.client_auth",
             "plait.daemon.address", "plait.daemon.telemetry_resource"):
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


# -- no arrow up the house ----------------------------------------------------------------------

# The rooms below the command line: none of them may import `plait.tools` (the CLI, the trainer,
# the benchmarks), at run time or for type checking. What the daemon's page shows and what
# the CLI prints are built in the daemon (`plait.daemon.job_reports`); the CLI draws them.
BELOW_THE_CLI = ("core", "daemon", "planner", "plugins", "integrations", "training")


def upward_imports() -> list[str]:
    found = []
    for folder in BELOW_THE_CLI:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imported_modules(path):
                if module == "plait.tools" or module.startswith("plait.tools."):
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{line}: imports {module}")
    return sorted(set(found))


def test_nothing_below_the_command_line_imports_it() -> None:
    assert upward_imports() == []


def test_an_upward_import_is_seen_even_for_type_checking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "daemon" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from plait.tools.daemon_views import TopView\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert "daemon/x.py:3: imports plait.tools.daemon_views" in upward_imports()


# -- rooms: core below everything, no circle between rooms, no core module one plugin owns -------


def room_of(path: Path) -> str:
    """The room a file is in: its top folder (`core`, `daemon`, `plugins`, …; the plugins
    together), or the top file's own name (`__init__`, `testing`)."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def room_imports() -> dict[str, dict[str, str]]:
    """room -> {room it imports: the first `file:line` doing so}, run-time and type-checking
    imports alike; the `plait` package itself is no room (it is every module's parent)."""
    modules = plait_modules()
    graph: dict[str, dict[str, str]] = {}
    for path in modules.values():
        edges = graph.setdefault(room_of(path), {})
        for line, names in import_targets(path):
            target = next((modules[n] for n in names if n in modules and n != "plait"), None)
            if target is None or room_of(target) == room_of(path):
                continue
            edges.setdefault(room_of(target), f"{path.relative_to(ROOT).as_posix()}:{line}")
    return graph


def room_circles(graph: dict[str, dict[str, str]]) -> list[str]:
    rooms = {room: dict.fromkeys(edges, 0) for room, edges in graph.items()}
    for edges in graph.values():
        for target in edges:
            rooms.setdefault(target, {})
    circles = []
    for component in strongly_connected(rooms):
        loop = shortest_loop(rooms, component[0])
        arrows = [
            f"{loop[i]} → {loop[i + 1]} ({graph[loop[i]][loop[i + 1]]})"
            for i in range(len(loop) - 1)
        ]
        circles.append(", ".join(arrows))
    return circles


def test_the_core_imports_no_other_room() -> None:
    assert room_imports().get("core", {}) == {}


def test_no_import_circle_between_rooms() -> None:
    assert room_circles(room_imports()) == []


def test_a_circle_between_rooms_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {
        "daemon/page.py": "from plait.planner.layouts import Layout\n",
        "planner/layouts.py": "if TYPE_CHECKING:\n    from plait.daemon.page import Page\n",
    }
    for relative, source in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source)
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert room_circles(room_imports()) == [
        "daemon → planner (daemon/page.py:1), planner → daemon (planner/layouts.py:2)"
    ]


def core_modules_one_plugin_owns() -> list[str]:
    """Core modules whose only importers (outside the module itself, tests aside) are the
    modules of a single plugin: a rule or formula that plugin owns, which belongs in its room."""
    modules = plait_modules()
    importers: dict[str, set[str]] = {}
    for name, path in modules.items():
        parts = path.relative_to(ROOT).parts
        who = "/".join(parts[:2]) if parts[0] == "plugins" else f"{room_of(path)}:{name}"
        for _, names in import_targets(path):
            for target in names:
                if target.startswith("plait.core.") and target in modules and target != name:
                    importers.setdefault(target, set()).add(who)
    owned = []
    for name, who in sorted(importers.items()):
        if len(who) == 1 and next(iter(who)).startswith("plugins/"):
            owned.append(f"{modules[name].relative_to(ROOT).as_posix()}: only {next(iter(who))}")
    return owned


def test_no_core_module_is_imported_only_by_a_single_plugin() -> None:
    assert core_modules_one_plugin_owns() == []


def test_a_core_module_one_plugin_owns_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {
        "core/engine.py": "from plait.core.records import R\n",
        "core/records.py": "R = 1\n",
        "core/byte_formulas.py": "BYTES = 2\n",
        "plugins/collectives/codecs.py": "from plait.core.byte_formulas import BYTES\n",
        "plugins/collectives/ring.py": "from plait.core import byte_formulas\n",
    }
    for relative, source in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source)
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert core_modules_one_plugin_owns() == ["core/byte_formulas.py: only plugins/collectives"]
