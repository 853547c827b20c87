"""An asynchronous save's copy of CUDA tensors: pinned host buffers, complete when `stage`
returns (the device-to-host copies are queued without blocking, then waited for once)."""

from __future__ import annotations

import pytest
import torch

from plait.core.dcp_planner import ChunkedValue
from plait.core.state_chunks import TensorPieces
from plait.plugins.checkpoint.staging import HostStaging

pytestmark = pytest.mark.cuda


def test_cuda_state_is_staged_into_pinned_memory_that_training_cannot_change() -> None:
    base = torch.randn(4096, 4096, device="cuda")
    expected = (base @ base).cpu()
    weight = base @ base  # still being computed when stage() is called: nothing synchronised
    staging = HostStaging()
    staged = staging.stage({"model.w": ChunkedValue(TensorPieces.whole(weight))})
    (chunk,) = staged["model.w"].pieces.chunks
    # Read on the host at once: complete only if stage() waited for its copies.
    assert chunk.tensor.device.type == "cpu" and chunk.tensor.is_pinned()
    assert torch.equal(chunk.tensor, expected)
    weight.mul_(2.0)  # training goes on
    torch.cuda.synchronize()
    assert torch.equal(chunk.tensor, expected)
    again = staging.stage({"model.w": ChunkedValue(TensorPieces.whole(weight))})
    assert again["model.w"].pieces.chunks[0].tensor.data_ptr() == chunk.tensor.data_ptr()
    assert torch.equal(again["model.w"].pieces.chunks[0].tensor, expected * 2.0)
