"""Checkpoint layout and storage: flat-shard chunks, resharded reads, manifest, fallback."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plait.core.dcp_planner import ChunkedValue, ChunkSavePlanner
from plait.core.state_chunks import TensorPieces, flat_range_chunks
from plait.plugins.checkpoint.offline import read_checkpoint, write_checkpoint
from plait.plugins.checkpoint.storage import (
    describe_files,
    find_latest_complete,
    list_checkpoints,
    publish,
    verify,
    write_manifest,
)


@pytest.mark.parametrize("shape", [(4, 5), (3, 4, 5), (7,)])
def test_flat_ranges_cover_exactly_with_few_chunks(shape: tuple[int, ...]) -> None:
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    total = full.numel()
    for start in range(total):
        for end in range(start + 1, total + 1):
            flat = full.flatten()[start:end].clone()
            chunks = flat_range_chunks(flat, start, shape)
            assert len(chunks) <= 2 * len(shape) - 1
            covered = torch.zeros(shape, dtype=torch.int32)
            for chunk in chunks:
                region = tuple(
                    slice(o, o + s) for o, s in zip(chunk.offsets, chunk.tensor.shape, strict=True)
                )
                assert torch.equal(full[region], chunk.tensor)
                covered[region] += 1
            flat_covered = covered.flatten()
            assert flat_covered[start:end].eq(1).all() and flat_covered.sum() == end - start


def test_chunks_are_views_of_the_flat_shard() -> None:
    flat = torch.zeros(9)
    for chunk in flat_range_chunks(flat, 3, (4, 5)):
        chunk.tensor.fill_(1.0)
    assert flat.eq(1).all()


def test_saved_flat_shards_read_back_whole(tmp_path: Path) -> None:
    """Three 'ranks' hold uneven flat shards; the checkpoint reads back as the whole tensor."""
    full = torch.randn(6, 7, generator=torch.Generator().manual_seed(0))
    flat = full.flatten()
    bounds = [0, 10, 29, 42]
    chunks = []
    for a, b in itertools.pairwise(bounds):
        chunks += flat_range_chunks(flat[a:b].clone(), a, full.shape)
    pieces = TensorPieces(full.shape, chunks)
    pieces.check("w")
    temp = tmp_path / ".tmp-step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model.w": ChunkedValue(pieces)},
            storage_writer=dcp.FileSystemWriter(temp),
            planner=ChunkSavePlanner(),
            no_dist=True,
        )
    write_manifest(temp, describe_files(temp, sorted(p.name for p in temp.iterdir())), 1)
    publish(tmp_path, temp, 1, keep=0)
    assert torch.equal(read_checkpoint(tmp_path, prefix="model.")["model.w"], full)


def test_truncated_or_corrupted_checkpoint_falls_back(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step, {"model.w": torch.full((64,), float(step))}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000002"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    newest = next((tmp_path / "step-00000003").glob("*.distcp"))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    verdict = verify(tmp_path / "step-00000003")
    assert not verdict.ok and "CRC-32" in verdict.problem
    assert verify(tmp_path / "step-00000003", checksums=False).ok  # same size: only CRC sees it
    path, rejected = find_latest_complete(tmp_path)
    assert path == tmp_path / "step-00000002"
    assert [v.path.name for v in rejected] == ["step-00000003"]
    (tmp_path / "step-00000002" / "manifest.json").unlink()  # an unfinished save
    path, rejected = find_latest_complete(tmp_path)
    assert path is None and "manifest.json" in rejected[-1].problem
