"""The held-out loss is the mean over every scored token, like the training loss: micro-batches
that score different numbers of tokens (packed rows, padding) weigh by their tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from plait.core.engine import Engine
from plait.training.validation import Validation

SEQ = 16
CONFIG = {
    "telemetry": {"enabled": False},
    "train": {"device": "cpu", "global_batch_size": 2, "micro_batch_size": 1, "eval_every": 1,
              "eval_batches": 1},
    "model": {"name": "llama", "size": "tiny"},
    "data": {"seq_len": SEQ},
}  # fmt: skip


def test_held_out_loss_weighs_micro_batches_by_their_scored_tokens() -> None:
    engine = Engine(config=CONFIG)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(3), torch.arange(13)]), torch.arange(SEQ)])
    targets = torch.roll(tokens, -1, 1)
    targets[0, 2] = targets[0, 15] = -100  # each document's last token
    targets[1, 4:] = -100  # the second row scores 4 tokens, the first 14
    batch = ({"tokens": tokens, "positions": positions}, targets)
    validation = Validation(engine, SimpleNamespace(batch_at=lambda step: batch))

    with torch.no_grad():
        logits = engine.module(tokens, positions=positions)
    every_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    row_means = [F.cross_entropy(logits[i], targets[i]).item() for i in range(2)]
    assert validation.loss() == pytest.approx(every_token, abs=1e-6)
    assert abs(every_token - sum(row_means) / 2) > 1e-3  # the mean of row means would differ
