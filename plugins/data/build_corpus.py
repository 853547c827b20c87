"""Assemble the bundled training corpus from documentation text shipped with CPython.

The corpus is English technical prose that exists on every machine that has Python, so plait's
demo and tests can train on real text without downloading anything:

1. the Python Language Reference help topics in `pydoc_data.topics` (the text `help("for")`
   prints), and
2. the docstrings of a fixed list of pure-Python standard-library modules, read from their
   source with `ast` (so a Python started with `-OO` produces the same text).

Both are © Python Software Foundation and distributed under the PSF License Agreement, which
permits redistribution with the notice kept; see `corpus/__init__.py`. The output depends on the
Python version it runs under, so the file is generated once and committed; regenerate with::

    python -m plait.plugins.data.build_corpus plugins/data/corpus/python_docs.txt
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Prose-heavy modules, in the order they are appended. Chosen for long explanatory docstrings.
STDLIB_MODULES = (
    "argparse",
    "collections/__init__",
    "functools",
    "textwrap",
    "json/__init__",
    "pathlib",
    "logging/__init__",
    "subprocess",
    "threading",
    "dataclasses",
    "difflib",
    "typing",
    "inspect",
    "shutil",
    "tempfile",
    "contextlib",
    "heapq",
    "random",
    "statistics",
    "fractions",
    "decimal",
    "email/message",
    "unittest/case",
    "asyncio/tasks",
    "zipfile",
    "tarfile",
    "enum",
    "string",
    "calendar",
    "datetime",
    "queue",
    "socket",
    "urllib/parse",
    "http/client",
    "codecs",
    "os",
    "doctest",
)

# Keep the committed file under 1 MB: whole modules are appended until the next would exceed it.
MAX_CORPUS_BYTES = 800_000


def help_topics() -> Iterator[str]:
    """The Language Reference help topics, in sorted order for a stable file."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].strip() + "\n"


def module_docstrings(relative_path: str) -> str:
    """All docstrings of one standard-library module, each under its qualified name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = (stdlib / f"{relative_path}.py").read_text(encoding="utf-8")
    module_name = relative_path.removesuffix("/__init__").replace("/", ".")
    sections: list[str] = []
    _collect(ast.parse(source), module_name, sections)
    return "".join(sections)


def _collect(node: ast.AST, qualname: str, sections: list[str]) -> None:
    docstring = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
    if docstring:
        sections.append(f"{qualname}\n{'=' * len(qualname)}\n\n{docstring.strip()}\n\n")
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            _collect(child, f"{qualname}.{child.name}", sections)


def build_corpus() -> str:
    parts = ["\n".join(help_topics())]
    size = len(parts[0].encode("utf-8"))
    for module in STDLIB_MODULES:
        text = module_docstrings(module)
        text_bytes = len(text.encode("utf-8")) + 1
        if size + text_bytes > MAX_CORPUS_BYTES:
            break
        parts.append(text)
        size += text_bytes
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m plait.plugins.data.build_corpus OUTPUT.txt")
    output = Path(args[0])
    text = build_corpus()
    output.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {output}: {len(text.encode('utf-8')):,} bytes, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
