"""Chat data end to end, as a user runs it: `plait data prepare --chat` a JSON Lines file of
conversations with a locally built tokenizer, then `plait train` on it with a held-out split.

The user's questions are random words and the assistant always answers the same sentence, so a
run that trains on the assistant's turns only (the default) learns its whole target in a few
steps, while the same tokens trained on everything (`--train-on all`) keep the unpredictable
questions in the loss: both the training and the validation loss show the mask was used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.chat_tokenizers import INSTRUCT, build_chat_tokenizer

PLAIT = [sys.executable, "-m", "plait.tools.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 16


def _plait(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=240, cwd=cwd, env=env
    )


def _conversations(path: Path) -> None:
    rng = np.random.default_rng(11)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "red", "blue"]
    rows = []
    for _ in range(200):
        question = " ".join(rng.choice(words, size=int(rng.integers(4, 10))))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": "two plus two is four."},
                ]
            }
        )
    rows[5] = {"messages": [{"role": "user", "content": "no answer"}]}
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _prepare_and_train(tmp_path: Path, train_on: str, vocab_size: int) -> list[dict]:
    prepared = _plait(
        "data", "prepare", "chats.jsonl", "-o", f"tokens-{train_on}", "--chat",
        "-t", "tokenizer", "--train-on", train_on, "--max-tokens", "64",
        cwd=tmp_path,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert "no assistant turn: 1" in " ".join(prepared.stdout.split())
    trained = _plait(
        "train",
        str(ROOT / "configs/tiny.toml"),
        "--set", f"data.path=tokens-{train_on}",
        "--set", "data.seq_len=64",
        "--set", f"model.overrides.vocab_size={vocab_size}",
        "--set", f"train.steps={STEPS}",
        "--set", "optimizer.lr=1e-2",
        "--set", "optimizer.warmup_steps=1",
        "--set", "train.global_batch_size=4",
        "--set", "train.micro_batch_size=2",
        "--set", "train.eval_every=8",
        "--set", "train.eval_fraction=0.2",
        "--set", "train.eval_batches=2",
        "--set", "telemetry.enabled=false",
        "--set", f"train.run_dir=run-{train_on}",
        cwd=tmp_path,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr
    lines = (tmp_path / f"run-{train_on}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(600)
def test_prepare_chat_then_train_on_the_assistant_turns(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_chat_tokenizer(tmp_path / "tokenizer", INSTRUCT)
    vocab_size = len(AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer")))
    _conversations(tmp_path / "chats.jsonl")
    assistant = _prepare_and_train(tmp_path, "assistant", vocab_size)
    everything = _prepare_and_train(tmp_path, "all", vocab_size)
    assert len(assistant) == len(everything) == STEPS
    # The same rows in both runs (the mask is the only difference) ...
    assert [m["tokens"] for m in assistant] == [m["tokens"] for m in everything]
    # ... and a different loss from the first step on.
    assert abs(assistant[0]["loss"] - everything[0]["loss"]) > 1e-3
    assert assistant[-1]["loss"] < assistant[0]["loss"] - 2.0, assistant  # it learns the answer
    # The questions' words stay unpredictable; the answer does not.
    assert assistant[-1]["loss"] < 0.75 * everything[-1]["loss"]
    validated = [(a["val_loss"], e["val_loss"]) for a, e in zip(assistant, everything, strict=True)]
    final_val = validated[-1]
    assert None not in final_val and final_val[0] < 0.75 * final_val[1], validated
