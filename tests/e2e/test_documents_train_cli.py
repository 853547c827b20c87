"""Documents end to end, as a user runs them: `plait data prepare` a JSON Lines corpus with a few
bad rows, then `plait train` on it, packed with document masking, once on one rank and once
with the rows cut over two context-parallel ranks (ring). The loss falls, and the two runs'
losses agree step by step: the cut changes how attention is computed, never what it sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PLAIT = [sys.executable, "-m", "plait.tools.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def _plait(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=240, cwd=cwd, env=env
    )


def _corpus(path: Path) -> None:
    """Sentences of a small grammar (learnable in a few steps), documents of 5–120 words."""
    rng = np.random.default_rng(7)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "."]
    lines = [
        json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(5, 120))))})
        for _ in range(160)
    ]
    lines[3] = '{"text": ""}'
    lines[40] = '{"body": "no text field"}'
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _train(tmp_path: Path, run: str, *settings: str) -> list[float]:
    trained = _plait(
        "train",
        str(ROOT / "configs/tiny.toml"),
        "--set", "data.path=tokens",
        "--set", "data.seq_len=64",
        "--set", "data.packing=concat_split",
        "--set", "model.overrides.vocab_size=257",
        "--set", f"train.steps={STEPS}",
        "--set", "train.global_batch_size=4",
        "--set", "train.micro_batch_size=2",
        "--set", "train.max_grad_norm=0.0",
        "--set", "telemetry.enabled=false",
        "--set", f"train.run_dir={run}",
        *settings,
        cwd=tmp_path,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr
    banner = " ".join(trained.stdout.split())
    assert "158 documents packed concat_split into" in banner, banner
    assert "padding, documents masked)" in banner, banner
    lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.timeout(600)
def test_prepare_then_train_packed_with_and_without_context_parallelism(tmp_path: Path) -> None:
    _corpus(tmp_path / "corpus.jsonl")
    prepared = _plait("data", "prepare", "corpus.jsonl", "-o", "tokens", cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert "skipped 2 bad rows" in " ".join(prepared.stdout.split())

    alone = _train(tmp_path, "cp1")
    ring = _train(
        tmp_path,
        "cp2",
        "--nproc-per-node", "2",
        "--set", "parallel.cp=2",
        "--set", "parallel.cp_strategy=ring",
    )  # fmt: skip
    assert len(alone) == len(ring) == STEPS
    assert alone[-1] < alone[0] - 0.5, alone  # it learns the grammar
    np.testing.assert_allclose(ring, alone, rtol=0, atol=2e-4)
