"""Model FLOPs of packed rows: attention counts each document's own nᵢ², not the row's T²."""

from __future__ import annotations

import torch

from plait.core.engine import Engine
from plait.core.flops import attention_flops_per_token

SEQ = 16
CONFIG = {
    "telemetry": {"enabled": False},
    "train": {"device": "cpu", "global_batch_size": 2},
    "model": {"name": "llama", "size": "tiny"},
    "data": {"seq_len": SEQ},
}


def _batch(lengths: list[list[int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (len(lengths), SEQ), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    targets = torch.roll(tokens, -1, dims=1)
    return {"tokens": tokens, "positions": positions}, targets


def test_packed_step_counts_each_documents_attention() -> None:
    engine = Engine(config=CONFIG)
    config = engine.model_config
    per_square = attention_flops_per_token(
        n_layers=config.n_layers, n_heads=config.n_heads, head_dim=config.head_dim, seq_len=1
    )
    dense = engine.flops_per_token - per_square * SEQ

    engine.train_step(_batch([[SEQ], [SEQ]]))
    whole_rows = engine.last_report.model_flops
    assert whole_rows == engine.flops_per_token * 2 * SEQ

    lengths = [[1, 2, 13], [5, 11]]
    engine.train_step(_batch(lengths))
    squares = sum(n * n for row in lengths for n in row)
    assert engine.last_report.model_flops == dense * 2 * SEQ + per_square * squares
    assert engine.last_report.model_flops < whole_rows
