"""The host copy an asynchronous save writes: no storage shared with the engine's tensors, the
same values, objects deep-copied, and buffers reused from one save to the next."""

from __future__ import annotations

import torch

from plait.core.dcp_planner import ChunkedValue
from plait.core.state_chunks import TensorChunk, TensorPieces
from plait.plugins.checkpoint.staging import HostStaging


def _state(weight: torch.Tensor, sampler: dict[str, list[int]]) -> dict[str, object]:
    # Two chunks of one global tensor, the second a strided (non-contiguous) view.
    pieces = TensorPieces(
        torch.Size([4, 6]),
        [TensorChunk((0, 0), weight[:2]), TensorChunk((2, 0), weight.t()[2:4])],
    )
    return {"model.w": ChunkedValue(pieces), "sampler": sampler}


def test_the_copy_owns_its_storage_and_objects() -> None:
    weight = torch.arange(36.0).reshape(6, 6)
    sampler = {"order": [3, 1, 2]}
    staging = HostStaging()
    staged = staging.stage(_state(weight, sampler))
    before = [c.tensor.clone() for c in staged["model.w"].pieces.chunks]
    weight.add_(100.0)  # training goes on
    sampler["order"].append(9)
    after = [c.tensor for c in staged["model.w"].pieces.chunks]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert staged["sampler"] == {"order": [3, 1, 2]}
    assert [c.offsets for c in staged["model.w"].pieces.chunks] == [(0, 0), (2, 0)]
    assert staged["model.w"].pieces.global_shape == torch.Size([4, 6])


def test_buffers_are_reused_and_refilled() -> None:
    weight = torch.zeros(6, 6)
    staging = HostStaging()
    first = staging.stage(_state(weight, {}))
    pointers = [c.tensor.data_ptr() for c in first["model.w"].pieces.chunks]
    weight.fill_(7.0)
    second = staging.stage(_state(weight, {}))
    assert [c.tensor.data_ptr() for c in second["model.w"].pieces.chunks] == pointers
    assert all(bool((c.tensor == 7.0).all()) for c in second["model.w"].pieces.chunks)
    assert staging.nbytes == 2 * 2 * 6 * 4
