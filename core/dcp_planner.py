"""DCP planners that write and read `TensorPieces` (rectangular chunks of named global tensors).

`torch.distributed.checkpoint` already knows how to store a tensor as chunks with offsets and to
read any overlapping set of chunks back (that is how it reshards DTensors); what it lacks is a
way to say "this rank holds these arbitrary rectangles of that tensor" for layouts that are not
DTensors (a flat ZeRO shard is up to three rectangles). `ChunkedValue` says it, and the two
planners look chunks up by offset. Identical chunks written by several ranks (replicated data)
are deduplicated by DCP's default global plan, so each is stored once. `read_tensors` reads a
DCP directory back whole in one process.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from plait.core.state_chunks import TensorPieces


class ChunkedValue:
    """A state-dict value DCP writes as the chunks of `pieces` (the `_Checkpointable` protocol)."""

    def __init__(self, pieces: TensorPieces) -> None:
        self.pieces = pieces

    def size(self) -> torch.Size:
        return torch.Size(self.pieces.global_shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        del obj
        items = []
        for i, chunk in enumerate(self.pieces.chunks):
            offsets = torch.Size(chunk.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets, i),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.tensor.shape),
                        properties=TensorProperties.create_from_tensor(chunk.tensor),
                        size=self.size(),
                    ),
                )
            )
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.shape)
            for c in self.pieces.chunks
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        chunks = self.pieces.chunks
        hint = index.index
        if (
            hint is not None
            and hint < len(chunks)
            and torch.Size(chunks[hint].offsets) == index.offset
        ):
            return chunks[hint].tensor
        for chunk in chunks:
            if torch.Size(chunk.offsets) == index.offset:
                return chunk.tensor
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offsets {index.offset}")


class ChunkSavePlanner(DefaultSavePlanner):
    """Saves a flat state dict whose tensor values may be `ChunkedValue`s."""

    def __init__(self) -> None:
        # The state dict is flat (dotted keys) already; keep it that way so keys are stable.
        super().__init__(flatten_state_dict=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if isinstance(value, ChunkedValue):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Loads into `ChunkedValue`s in place; non-tensor values are replaced in the dict."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        # NOTE: the default set-up walks the dict to materialise meta tensors and, doing so,
        # replaces values of types it does not know (our `ChunkedValue`s) with None. Our values
        # are always real storage, so there is nothing to materialise.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, ChunkedValue):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


def read_tensors(directory: Path, *, prefix: str = "", with_objects: bool = True) -> dict[str, Any]:
    """Every entry of a DCP directory whose key starts with `prefix`, tensors whole, on the CPU
    (no manifest needed: a staging directory reads too)."""
    reader = dcp.FileSystemReader(directory)
    state: dict[str, Any] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if isinstance(md, TensorStorageMetadata):
            full = torch.empty(md.size, dtype=md.properties.dtype)
            state[key] = ChunkedValue(TensorPieces.whole(full))
        elif isinstance(md, BytesStorageMetadata) and with_objects:
            state[key] = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(), no_dist=True)
    return {
        k: (v.pieces.chunks[0].tensor if isinstance(v, ChunkedValue) else v)
        for k, v in state.items()
    }
