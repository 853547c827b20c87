"""The documentation's file blocks: fenced code whose first line is a comment naming a file.

```python
# plait-int8/plait_int8/__init__.py
...
```

The pages are README.md and every page under docs/ (the plugin examples are in
docs/plugins.md, `plait.observe`'s scripts in docs/observe.md, the `transformers` loop in
docs/your-own-model.md). Tests write these files exactly as the pages show them, so an example
that stops working fails a test instead of misleading a reader.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FILE_BLOCK = re.compile(r"```(?:python|toml)\n# ([\w./-]+\.(?:py|toml))\n(.*?)```", re.DOTALL)
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def doc_pages() -> list[Path]:
    """README.md, then the pages under docs/ in name order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def page(name: str) -> str:
    """The text of one page under docs/, e.g. `page("plugins.md")`."""
    return (DOCS / name).read_text()


def python_blocks(text: str) -> list[str]:
    """Every ```python block of a page, in order."""
    return _PYTHON_BLOCK.findall(text)


def doc_files(text: str | None = None) -> dict[str, str]:
    """Path → content (the naming comment included) of every file block, in page order.

    `text` reads one text instead of the pages (tests of this module)."""
    texts = [text] if text is not None else [path.read_text() for path in doc_pages()]
    files: dict[str, str] = {}
    for page_text in texts:
        for match in _FILE_BLOCK.finditer(page_text):
            path = match.group(1)
            if path in files:
                raise AssertionError(f"the docs name {path} in two code blocks")
            files[path] = f"# {path}\n{match.group(2)}"
    return files


def write_files(root: Path, prefix: str = "", text: str | None = None) -> list[Path]:
    """Write the docs' files under `prefix` (e.g. "plait-int8/") into `root`."""
    written = []
    for name, content in doc_files(text).items():
        if not name.startswith(prefix):
            continue
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written
