"""A MoE model's expert counts on CUDA: published on the training thread without a device sync,
copied to pinned host memory behind an event, and read back exactly on another thread (the
telemetry exporter's) once the copies land, even while the device is still busy with the work
the counts depend on."""

from __future__ import annotations

import threading

import torch

from plait.core.span_board import SpanBoard
from plait.plugins.expert_parallel.expert_load import ExpertLoad, publish_expert_load


def test_expert_counts_cross_to_the_host_behind_an_event() -> None:
    board = SpanBoard()
    device = torch.device("cuda")
    # Queue a few hundred milliseconds of work the counts depend on, so the copy lands late.
    work = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        work = work @ work / 64
    depends = torch.nan_to_num(work.sum() * 0)
    tokens = torch.tensor([[3.0, 1.0], [0.0, 4.0]], device=device) + depends
    dropped = torch.tensor([2.0, 0.0], device=device) + depends

    publish_expert_load(["moe.0", "moe.1"], tokens, dropped, board=board)
    (published,) = board.take()
    assert published.copied is not None
    assert published.tokens.device.type == "cpu" and published.tokens.is_pinned()

    resolved: list[ExpertLoad] = []
    reader = threading.Thread(target=lambda: resolved.append(published.resolve()))
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "resolving the counts never finished"
    (load,) = resolved
    assert [(layer.layer, layer.tokens_per_expert, layer.dropped) for layer in load.layers] == [
        ("moe.0", (3, 1), 2),
        ("moe.1", (0, 4), 0),
    ]
    assert board.take() == []  # taken once
