"""MkDocs hooks for the site under docs/ (named in mkdocs.yml; run by `make docs`).

The pages are written for GitHub's Markdown too, where a pipe inside a table cell must be
escaped even inside a code span (`--nnodes N\\|MIN:MAX`). Python-Markdown's tables already keep
a code span's pipes in their cell and would print the backslash, so it is dropped there.
"""

from __future__ import annotations

import re
from typing import Any

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
