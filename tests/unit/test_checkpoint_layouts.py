"""Regions of the declared state layout: flat shards of tensor-parallel slices land at their
place in the global tensor; scheduler state fitted to another optimizer group count."""

from __future__ import annotations

import pytest
import torch

from plait.core.state_chunks import region_chunks, tensor_pieces
from plait.core.state_layout import Region, TensorLayout
from plait.core.training_state import fit_scheduler_state
from plait.plugins.checkpoint.storage import CheckpointError


@pytest.mark.parametrize(
    ("dim", "start", "stop"),
    [(0, 3, 6), (1, 2, 4)],
    ids=["column-parallel rows", "row-parallel columns"],
)
@pytest.mark.parametrize(("flat_start", "flat_end"), [(0, 12), (2, 9), (5, 6), (3, 11)])
def test_flat_range_of_a_slice_lands_at_its_global_position(
    dim: int, start: int, stop: int, flat_start: int, flat_end: int
) -> None:
    full = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    local = full.narrow(dim, start, stop - start).contiguous()
    offsets = [0, 0]
    offsets[dim] = start
    block = Region.whole(full.shape).narrow(dim, start, stop - start)
    assert block == Region.whole(local.shape).shifted(offsets)

    flat = local.reshape(-1)[flat_start:flat_end].clone()
    chunks = region_chunks(block.flat_range(flat_start, flat_end), flat)

    rebuilt = torch.full_like(full, -1.0)
    for chunk in chunks:
        index = tuple(
            slice(o, o + n) for o, n in zip(chunk.offsets, chunk.tensor.shape, strict=True)
        )
        rebuilt[index] = chunk.tensor
    expected = torch.full_like(full, -1.0)
    mask = torch.zeros(local.numel(), dtype=torch.bool)
    mask[flat_start:flat_end] = True
    expected.narrow(dim, start, stop - start).copy_(
        torch.where(mask.view(local.shape), local, torch.tensor(-1.0))
    )
    assert torch.equal(rebuilt, expected)
    # The chunks view the flat shard: loading into them fills it in place.
    for chunk in chunks:
        chunk.tensor.fill_(0.0)
    assert torch.equal(flat, torch.zeros_like(flat))


def test_whole_tensor_is_one_chunk_and_replicas_are_written_once() -> None:
    tensor = TensorLayout.whole(torch.ones(3, 2), replicated_over=("dp",))
    pieces = tensor_pieces(tensor)
    assert pieces.global_shape == torch.Size([3, 2])
    assert [c.offsets for c in pieces.chunks] == [(0, 0)]

    # Only the first rank along the replication axes writes a replicated tensor; a shard is
    # written by every rank that holds one.
    def second_dp_rank(axes: tuple[str, ...]) -> bool:
        return "dp" not in axes

    assert tensor_pieces(tensor, is_writer=second_dp_rank).chunks == []
    sliced = tensor.sharded_along("dp", global_shape=(6, 2), offsets=(3, 0))
    assert sliced.replicated_over == () and sliced.sharded_over == ("dp",)
    assert [c.offsets for c in tensor_pieces(sliced, is_writer=second_dp_rank).chunks] == [(3, 0)]


def test_scheduler_state_fits_another_group_count() -> None:
    saved = {"base_lrs": [3e-3, 3e-3], "_last_lr": [1e-3, 1e-3], "last_epoch": 2}
    fitted = fit_scheduler_state(saved, 1)
    assert fitted["base_lrs"] == [3e-3] and fitted["_last_lr"] == [1e-3]
    assert fit_scheduler_state(saved, 2) == saved
    with pytest.raises(CheckpointError, match="different base_lrs"):
        fit_scheduler_state({"base_lrs": [1e-3, 2e-3]}, 1)
