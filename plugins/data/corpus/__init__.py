"""The bundled corpus: its text file, and its token files prepared once into a cache directory.

`python_docs.txt` (about 790 KB of English technical prose) is CPython 3.11's Language Reference
help topics (`pydoc_data.topics`) followed by the docstrings of a fixed list of standard-library
modules, assembled by `plait.plugins.data.build_corpus`. The text is Copyright © 2001 Python
Software Foundation; All Rights Reserved, and is redistributed under the PSF License Agreement
(https://docs.python.org/3/license.html), which allows redistribution of derived works that keep
this notice.

This folder is a package (rather than a `corpus.py` beside a data folder) so setuptools ships the
text file as package data through the `*.txt` pattern in pyproject.toml.

`bundled_corpus_dir()` is what a config with `data.path = ''` trains on. It is prepared as one
token stream (no documents.bin, no EOS, vocab 256), so it keeps the byte-level models' vocabulary
and the stream sampler reads it in windows; `data.packing` applies to prepared documents only.
The cache key is the SHA-256 of the corpus text plus the tokenizer name, so editing the corpus or
changing the tokenizer prepares a new directory instead of reusing a stale one. Several ranks of
one node may call it at the same time: each prepares into a private temporary directory and
renames it into place, and whoever loses the race discards its copy and uses the winner's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from plait.plugins.data.token_files import TokenFile, TokenFileError, prepare_token_files
from plait.plugins.data.tokenizer import ByteTokenizer

CACHE_ENV = "PLAIT_CACHE_DIR"
CORPUS_FILE = Path(__file__).with_name("python_docs.txt")


def default_cache_dir() -> Path:
    """`$PLAIT_CACHE_DIR`, else `$XDG_CACHE_HOME/plait`, else `~/.cache/plait`."""
    if explicit := os.environ.get(CACHE_ENV):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "plait"


def bundled_corpus_file() -> Path:
    """The bundled text file (package data of `plait.plugins.data.corpus`)."""
    if not CORPUS_FILE.is_file():
        raise TokenFileError(
            f"bundled corpus {CORPUS_FILE} is missing; the plait installation is incomplete"
        )
    return CORPUS_FILE


def bundled_corpus_key() -> str:
    """The cache key: tokenizer name and the first 16 hex digits of the corpus SHA-256."""
    digest = hashlib.sha256(bundled_corpus_file().read_bytes()).hexdigest()
    return f"python-docs-{ByteTokenizer.name}-{digest[:16]}"


def bundled_corpus_dir(cache_dir: Path | str | None = None) -> Path:
    """The token-file directory of the bundled corpus, preparing it on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / bundled_corpus_key()
    if _is_valid(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        prepare_token_files([bundled_corpus_file()], staging, tokenizer=ByteTokenizer())
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other.
        if target.exists() and not _is_valid(target):
            # A directory left broken by an interrupted older version of this code.
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another process renamed its copy into place first; theirs is as good as ours.
            if not _is_valid(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_valid(directory: Path) -> bool:
    try:
        TokenFile(directory)
    except TokenFileError:
        return False
    return True
