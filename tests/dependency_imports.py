"""Every import of the `plait` package against the distribution's declared requirements.

Run inside an environment where plait is installed (the dev venv, or a fresh venv holding the
built wheel): `python dependency_imports.py` prints the problems, one a line, and exits 1 if
there are any. It imports nothing of plait: the package's files are parsed with `ast`, and its
requirements are read from the installed metadata, so it checks what a user really gets.

Rules:

* every third-party module imported anywhere in the package belongs to a declared requirement
  (a base one or one of an extra);
* an import that runs when its module is imported (at module level, not under `try` nor
  `if TYPE_CHECKING`, not inside a function) of an extra's distribution is allowed only in
  modules that exist for that extra (`OPTIONAL_MODULES`): importing any other module never
  needs an extra.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# Module prefix -> the extras whose distributions it may import at module level.
OPTIONAL_MODULES: dict[str, frozenset[str]] = {
    "plait.plugins.kernels_triton": frozenset({"triton"}),  # imported lazily by its plugin
    "plait.testing": frozenset({"testing"}),  # a pytest plugin for plugin packages' tests
    "plait.tools.pytest_outcomes": frozenset({"testing"}),  # a pytest plugin (gpu_check)
    # Adapters for the trainers they plug into, imported by those trainers' users only.
    "plait.integrations.lightning": frozenset({"lightning"}),
    "plait.integrations.transformers": frozenset({"hf"}),
    "plait.tools.bench": frozenset({"dev", "deepspeed", "hf"}),  # benchmark scripts
    "plait.tools.gen_protos": frozenset({"dev"}),  # `make protos`
}
# Import names that differ from their distribution's name, for distributions this environment
# may not have installed (an extra's): what `packages_distributions` would say if it were.
KNOWN_IMPORT_NAMES: dict[str, str] = {
    "grpc_tools": "grpcio-tools",
    "pynvml": "nvidia-ml-py",
    "google": "protobuf",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "tomli": "tomli",
}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module, "plait.core.config"
    line: int
    top: str  # the imported top-level name, "torch"
    eager: bool  # runs when the importing module is imported


def package_files(root: Path) -> list[Path]:
    """The package's `.py` files under `root` (the installed `plait` folder, or a checkout,
    whose package folders are the top-level ones holding an `__init__.py`)."""
    if not (root / "setup.py").is_file():
        return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    files = [p for p in root.glob("*.py") if p.name != "setup.py"]
    for folder in sorted(p.parent for p in root.glob("*/__init__.py")):
        files.extend(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def module_name(root: Path, path: Path) -> str:
    parts = ["plait", *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, eager: bool) -> Iterator[tuple[int, str, bool]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0], eager
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module.split(".")[0], eager
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(node, False)
        elif isinstance(node, ast.Try):
            # Guarded: a module-level `try: import x / except ImportError` copes without it.
            yield from _imports(node, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), False)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), eager)
        else:
            yield from _imports(node, eager)


@functools.cache
def package_imports(root: Path) -> tuple[Import, ...]:
    """Every absolute import in the package's `.py` files, by top-level name."""
    out = []
    for path in package_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        name = module_name(root, path)
        for line, top, eager in _imports(tree, True):
            out.append(Import(name, line, top, eager))
    return tuple(out)


def declared_requirements(requirements: list[str]) -> dict[str, set[str]]:
    """Normalised distribution name -> the extras that bring it ("" for a base requirement),
    from requirement lines as the metadata writes them (`triton>=3.0; extra == "triton"`)."""
    out: dict[str, set[str]] = {}
    for text in requirements:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text)
        if match is None:
            continue
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", text)
        out.setdefault(normalise(match.group(1)), set()).add(extra.group(1) if extra else "")
    return out


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distributions_of(top: str) -> set[str]:
    found = {normalise(d) for d in _installed_distributions().get(top, [])}
    if top in KNOWN_IMPORT_NAMES:
        found.add(normalise(KNOWN_IMPORT_NAMES[top]))
    return found or {normalise(top)}


def _allowed_extras(module: str) -> frozenset[str]:
    for prefix, extras in OPTIONAL_MODULES.items():
        if module == prefix or module.startswith(prefix + "."):
            return extras
    return frozenset()


def problems(root: Path, requirements: list[str]) -> list[str]:
    """One line per import under `root` that `requirements` (metadata lines) do not cover."""
    declared = declared_requirements(requirements)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for item in package_imports(root):
        if item.top in stdlib or item.top == "plait":
            continue
        dists = distributions_of(item.top)
        extras = set().union(*(declared.get(d, set()) for d in dists))
        where = f"{item.module}:{item.line}: imports {item.top}"
        if not extras:
            found.append(f"{where}, which no declared requirement provides")
        elif item.eager and "" not in extras and not extras & _allowed_extras(item.module):
            needed = ", ".join(sorted(extras))
            found.append(f"{where} at import time, but only the extra [{needed}] provides it")
    return found


def main() -> int:
    import plait

    root = Path(plait.__file__).resolve().parent
    found = problems(root, metadata.requires("plait") or [])
    for line in found:
        print(line)
    print(f"checked {len(package_imports(root))} imports under {root}: {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
