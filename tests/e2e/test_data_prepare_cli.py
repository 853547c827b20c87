"""`plait data prepare` and `plait data info` as a user runs them: a JSON Lines corpus with a few
bad rows, through the installed command line, then its histogram as a picture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from plait.plugins.data import TokenFile

PLAIT = [sys.executable, "-m", "plait.tools.cli"]


def _plait(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_prepare_a_jsonl_corpus_then_show_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    texts = [" ".join(["word"] * int(rng.integers(1, 200))) for _ in range(60)]
    lines = [json.dumps({"text": text}) for text in texts]
    lines[10] = '{"text": 7}'
    lines[20] = "{broken"
    lines[30] = '{"title": "no text"}'
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")

    prepared = _plait(
        "data", "prepare", "corpus.jsonl", "-o", "out", "--workers", "2", cwd=tmp_path
    )
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    output = " ".join(prepared.stdout.split())
    assert "skipped 3 bad rows (invalid JSON: 1, missing field: 1, not a string: 1)" in output
    assert "corpus.jsonl row 11: not a string (int)" in output
    assert "corpus.jsonl row 21: invalid JSON" in output
    assert "corpus.jsonl row 31: missing field" in output
    assert "EOS id 256 (added by plait), vocab 257, dtype uint16" in output

    token_file = TokenFile(tmp_path / "out", verify_checksum=True)
    kept = [t for i, t in enumerate(texts) if i not in (10, 20, 30)]
    assert token_file.meta.documents == len(kept) == 57
    assert token_file.count == sum(len(t) + 1 for t in kept)

    shown = _plait("data", "info", "out", "--png", "h.png", "--verify", cwd=tmp_path)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    info = " ".join(shown.stdout.split())
    lengths = np.array([len(t) + 1 for t in kept])
    assert f"documents │ {len(kept)}" in info and "(verified)" in info
    assert f"max {lengths.max():,}" in info and f"p50 {np.percentile(lengths, 50):,.0f}" in info
    assert "skipped rows │ invalid JSON: 1, missing field: 1, not a string: 1" in info
    assert "tokens │█" in info and "histogram written to h.png" in info  # the text histogram
    png = (tmp_path / "h.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
