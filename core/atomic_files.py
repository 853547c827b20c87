"""Files other processes read while this one writes: written beside the target under a name of
this process's own, then renamed over it, so a reader sees the old file or the new one whole."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, document: Any, *, indent: int = 1) -> None:
    """`document` as JSON at `path` (parents created); raises OSError as writing does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(document, indent=indent, sort_keys=True))
    os.replace(partial, path)  # one rename: readers never see a half-written file
