"""plait's LoRA fine-tuning on chat data equals TRL's `SFTTrainer`, step by step.

The same conversations are rendered by `plait data prepare --chat` (assistant turns trained) and
by TRL (`assistant_only_loss=True`) through one tokenizer's chat template with generation
markers; the same tiny transformers Llama with the same LoRA adapters is trained on them, in
the same order, by TRL in one process and by plait on 2 Gloo ranks under ZeRO-3 (the rows read
by the sampler `plait train` uses). Both report the mean loss over the assistant tokens of the
global batch, so the fp32 losses agree within 1e-4 at every step. `trl_equality_runs.py` says
what each side is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plait.testing.distributed import run_distributed
from tests.chat_tokenizers import MARKED, build_chat_tokenizer
from tests.e2e import trl_equality_runs as runs

pytest.importorskip("peft")
pytest.importorskip("trl")

CONVERSATIONS = 90  # more than STEPS × GLOBAL_BATCH: the sampler's shuffle picks which train


def _prepare(tmp_path: Path) -> Path:
    chats = tmp_path / "chats.jsonl"
    lines = [json.dumps({"messages": m}) + "\n" for m in runs.conversations(CONVERSATIONS)]
    chats.write_text("".join(lines), encoding="utf-8")
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    prepared = subprocess.run(
        [sys.executable, "-m", "plait.tools.cli", "data", "prepare", str(chats),
         "-o", str(tmp_path / "tokens"), "--chat", "-t", str(tmp_path / "tokenizer"),
         "--max-tokens", str(runs.SEQ), "--workers", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    return tmp_path / "tokens"


@pytest.mark.timeout(240)
def test_lora_on_chat_data_equals_trl_sft_trainer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from plait.plugins.data import TokenFile

    build_chat_tokenizer(tmp_path / "tokenizer", MARKED)
    vocab_size = len(AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer")))
    directory = _prepare(tmp_path)
    token_file = TokenFile(directory)
    assert token_file.documents is not None and token_file.documents.count == CONVERSATIONS

    order = runs.plait_order(directory)
    rows = runs.conversations(CONVERSATIONS)
    trl = runs.train_trl(tmp_path / "tokenizer", [rows[i] for i in order], tmp_path / "trl")

    # The same tokens and the same trained tokens, row by row: plait's document is TRL's row
    # and the EOS plait ends every document with (never trained on assistant turns).
    tokens, mask = token_file.tokens, token_file.loss_mask
    assert mask is not None
    eos = token_file.meta.eos_id
    for row, conversation in enumerate(order):
        start = int(token_file.documents.starts[conversation])
        length = int(token_file.documents.lengths[conversation])
        ids = np.asarray(tokens[start : start + length], dtype=np.int64)
        assert ids.tolist() == [*trl["input_ids"][row], eos], row
        trained = np.asarray(trl["labels"][row]) != -100
        assert np.asarray(mask[start : start + length - 1], dtype=bool).tolist() == trained.tolist()
        assert not mask[start + length - 1]

    ranks = run_distributed(runs.train_plait, 2, str(directory), vocab_size, timeout=200)
    assert ranks[0] == ranks[1]  # the step's loss is the global batch's, on every rank
    plait_losses, trl_losses = ranks[0], trl["losses"]
    assert len(plait_losses) == len(trl_losses) == runs.STEPS
    worst = max(abs(a - b) for a, b in zip(plait_losses, trl_losses, strict=True))
    assert worst <= 1e-4, f"max |Δ| = {worst:.2e}\nplait {plait_losses}\ntrl   {trl_losses}"
    print(f"max |Δ| = {worst:.2e}", *zip(plait_losses, trl_losses, strict=True), sep="\n")
    assert trl_losses[-1] < trl_losses[0] - 0.25  # it trained: not a comparison of two nothings
