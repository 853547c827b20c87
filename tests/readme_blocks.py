"""The README's file blocks: fenced code whose first line is a comment naming a file.

```python
# plait-int8/plait_int8/__init__.py
...
```

Tests write these files exactly as the README shows them, so an example that stops working
fails a test instead of misleading a plugin author.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_FILE_BLOCK = re.compile(r"```(?:python|toml)\n# ([\w./-]+\.(?:py|toml))\n(.*?)```", re.DOTALL)


def readme_files(text: str | None = None) -> dict[str, str]:
    """Path → content (the naming comment included) of every file block, in README order."""
    text = README.read_text() if text is None else text
    files: dict[str, str] = {}
    for match in _FILE_BLOCK.finditer(text):
        path = match.group(1)
        if path in files:
            raise AssertionError(f"README names {path} in two code blocks")
        files[path] = f"# {path}\n{match.group(2)}"
    return files


def write_files(root: Path, prefix: str = "", text: str | None = None) -> list[Path]:
    """Write the README files under `prefix` (e.g. "plait-int8/") into `root`."""
    written = []
    for name, content in readme_files(text).items():
        if not name.startswith(prefix):
            continue
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written
