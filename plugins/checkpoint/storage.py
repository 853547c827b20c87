"""Checkpoint directories on disk: atomic publication, the manifest, `latest`, pruning, verifying.

    <dir>/
      latest                    "step-00000200" (written to a temporary file and renamed, last)
      step-00000100/            a complete checkpoint
        .metadata               DCP's index of every tensor chunk and object
        __0_0.distcp …          DCP's data files, one per writing rank
        manifest.json           size and CRC-32 of every file above, written last
      .tmp-step-00000300/       a save in progress (or one a crash interrupted)

A checkpoint is published by renaming its temporary directory once every file and the manifest
are written and synced, so a directory named `step-*` is complete unless the disk lost data
afterwards; the manifest catches that (truncated or corrupted files), and loading then falls back
to the previous complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from plait.core.errors import CheckpointError

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_READ_BLOCK = 1 << 22


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def temp_dir_name(step: int) -> str:
    return f".tmp-{step_dir_name(step)}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(_READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def describe_files(directory: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """{name: {"size": bytes, "crc32": checksum}} for files in `directory`."""
    return {
        name: {"size": (directory / name).stat().st_size, "crc32": file_crc32(directory / name)}
        for name in names
    }


def write_json_atomic(path: Path, data: object) -> None:
    """Write to a temporary sibling, fsync, rename: readers see the old or the new file only."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, files: dict[str, dict[str, int]], step: int) -> None:
    write_json_atomic(
        directory / MANIFEST, {"version": MANIFEST_VERSION, "step": step, "files": files}
    )


def publish(root: Path, temp: Path, step: int, *, keep: int) -> Path:
    """Rename a finished temporary directory to `step-N`, point `latest` at it, prune old ones."""
    final = root / step_dir_name(step)
    if final.exists():
        # A re-save of the same step (e.g. after a restart that resumed before it): replace it.
        shutil.rmtree(final)
    os.replace(temp, final)
    fsync_dir(root)
    write_text_atomic(root / LATEST, final.name + "\n")
    fsync_dir(root)
    prune(root, keep=keep, protect=final)
    return final


def prune(root: Path, *, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` step directories (0 keeps all) and stale temporaries."""
    removed: list[Path] = []
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    if keep <= 0:
        return removed
    for old in list_checkpoints(root)[keep:]:
        if protect is not None and old == protect:
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


def list_checkpoints(root: Path) -> list[Path]:
    """Step directories under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for s, p in sorted(((s, p) for s, p in found if s is not None), reverse=True)]


@dataclass(frozen=True, slots=True)
class Verdict:
    path: Path
    ok: bool
    problem: str = ""


def verify(directory: Path, *, checksums: bool = True) -> Verdict:
    """Check a checkpoint directory against its manifest (sizes, and CRC-32s if `checksums`)."""
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        return Verdict(directory, False, "directory does not exist")
    if not manifest_path.is_file():
        return Verdict(directory, False, f"no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return Verdict(directory, False, f"{MANIFEST} is unreadable: {exc}")
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return Verdict(directory, False, f"{name} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            return Verdict(
                directory,
                False,
                f"{name} has {size} bytes, the manifest says {expected['size']} (truncated?)",
            )
        if checksums and file_crc32(path) != expected["crc32"]:
            return Verdict(directory, False, f"{name} fails its CRC-32 check (corrupted)")
    return Verdict(directory, True)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from a path that is one, or a root holding a `latest` pointer."""
    if (path / MANIFEST).is_file() or step_of(path) is not None:
        return path
    pointer = path / LATEST
    if pointer.is_file():
        return path / pointer.read_text().strip()
    newest = list_checkpoints(path)
    if newest:
        return newest[0]
    raise CheckpointError(f"{path} is neither a checkpoint nor a directory holding checkpoints")


def find_latest_complete(
    root: Path, *, checksums: bool = True
) -> tuple[Path | None, list[Verdict]]:
    """The newest checkpoint under `root` that verifies, and the verdicts on those that did not.

    Step directories are tried from the newest down: one published just before a crash, before
    `latest` was rewritten, is complete and is used; one whose files were damaged afterwards is
    skipped in favour of the previous one. (`latest` is for people and tools.)
    """
    candidates = list_checkpoints(root)
    rejected: list[Verdict] = []
    for candidate in candidates:
        verdict = verify(candidate, checksums=checksums)
        if verdict.ok:
            return candidate, rejected
        log.warning("checkpoint %s is unusable: %s", candidate, verdict.problem)
        rejected.append(verdict)
    return None, rejected
