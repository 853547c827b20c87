"""Rank function: a `transformers` Llama through `plait.initialize` with only `parallel.pp = 2`
named, one step, against the user's plain single-process loop on the same batch."""

from __future__ import annotations

from typing import Any

import torch

import plait
from tests.dist import hf_workers

ROWS = 8  # sequences per rank: pp = 2 leaves one data-parallel replica holding the whole batch


def one_step_with_only_pp(rank: int, world_size: int) -> dict[str, Any]:
    del rank, world_size
    tokens = torch.randint(
        0, hf_workers.VOCAB, (ROWS, hf_workers.SEQ), generator=torch.Generator().manual_seed(1)
    )
    reference = hf_workers.build("llama")  # seeded: the same weights on every rank
    loss = reference(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = [p.grad.norm() for p in reference.parameters() if p.grad is not None]
    reference_grad_norm = torch.linalg.vector_norm(torch.stack(grads)).item()

    # Telemetry off only to keep the test from looking for a daemon: the layout is pp alone.
    config = {"parallel": {"pp": 2}, "telemetry": {"enabled": False}}
    engine = plait.initialize(hf_workers.build("llama"), config=config)
    got = engine.train_step({"input_ids": tokens, "labels": tokens})
    result = {
        "loss": got,
        "reference_loss": loss.item(),
        "grad_norm": float(engine.last_report.grad_norm),
        "reference_grad_norm": reference_grad_norm,
        "micro_batch_size": engine.micro_batch_size(ROWS),
        "schedule": engine.config.schedule.name,
    }
    engine.close()
    return result
