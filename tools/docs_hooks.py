"""MkDocs hooks for the site under docs/ (named in mkdocs.yml; run by `make docs`).

The navigation is every page found under docs/ when the site is built: those `READING_ORDER`
names in its order, then the rest by path. A new page needs no edit anywhere to be in the site,
and a page the list names that is not there is left out (a fixed `nav:` in mkdocs.yml would fail
the strict build on it; without one, mkdocs would order the pages by file name).

The pages are written for GitHub's Markdown too, where a pipe inside a table cell must be
escaped even inside a code span (`--nnodes N\\|MIN:MAX`). Python-Markdown's tables already keep
a code span's pipes in their cell and would print the backslash, so it is dropped there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

READING_ORDER = (
    "index.md",
    "training.md",
    "chat-data.md",
    "parallelisms.md",
    "zero-plus-plus.md",
    "offload.md",
    "your-own-model.md",
    "fine-tuning.md",
    "how-a-step-runs.md",
    "planning.md",
    "plugins.md",
    "daemon.md",
    "multi-node-jobs.md",
    "web-page.md",
    "observe.md",
    "telemetry-schema.md",
    "checkpoints.md",
    "fault-tolerance.md",
    "elastic.md",
    "gpu-nodes.md",
    "cli.md",
    "benchmarks.md",
    "layout.md",
)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def unescape_table_code_pipes(markdown: str) -> str:
    """`\\|` → `|` inside the code spans of table rows; everything else unchanged."""
    lines = []
    fenced = False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("|") and "\\|" in line:
            line = _CODE_SPAN.sub(lambda span: span.group(0).replace("\\|", "|"), line)
        lines.append(line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return unescape_table_code_pipes(markdown)


def reading_order(page: str) -> tuple[int, str]:
    """Sort key of a page's path under docs/: the pages `READING_ORDER` names first, in its
    order; then the rest by path."""
    rank = READING_ORDER.index(page) if page in READING_ORDER else len(READING_ORDER)
    return rank, page


def pages_in_reading_order(docs_dir: Path) -> list[str]:
    """Every Markdown page under `docs_dir` (hidden ones left out, as mkdocs does)."""
    pages = [
        path.relative_to(docs_dir).as_posix()
        for path in docs_dir.rglob("*.md")
        if not any(part.startswith(".") for part in path.relative_to(docs_dir).parts)
    ]
    return sorted(pages, key=reading_order)


def on_config(config: Any, **_: Any) -> Any:
    # mkdocs sorts the pages by name when mkdocs.yml has no `nav:`; hand it the order instead.
    if config.nav is None:
        config.nav = pages_in_reading_order(Path(config.docs_dir))
    return config
