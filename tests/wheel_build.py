"""Build plait's wheel from a clean copy of the checkout's files.

NOTE: setuptools builds in the source folder's `build/`, and a wheel built there again ships
whatever an earlier build left in it (a file since removed from the package included): tests
build from a copy of the files git knows (tracked, or new and not ignored) instead.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(folder: Path) -> Path:
    """The wheel of the checkout as it is now, built in `folder` (returns its path)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    source = folder / "source"
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    dist = folder / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(source)],
        check=True, cwd=folder, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("plait-*.whl")
    return wheel
