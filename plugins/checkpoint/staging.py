"""Host copies of a rank's checkpoint state, so training can go on while a thread writes them.

    staging = HostStaging()
    state = staging.stage(engine_state_dict(engine, batches=batches))   # the step waits for this
    threading.Thread(target=save_state_dict, args=(state, temp), ...).start()
    ...                                                                 # training mutates freely
    # the next stage() may reuse the buffers only once that write has finished

Every tensor chunk is copied into a host buffer that is kept between saves (allocating and, on
CUDA, pinning a full copy of the state every few steps would cost more than the copy itself);
pinned buffers let the device-to-host copies run asynchronously, and one stream synchronisation
waits for all of them. Objects (sampler position, hyperparameters, RNG states, plugins' state)
are deep-copied: DCP pickles them only when it writes, long after the step that owned them.

The buffers are one full copy of what this rank writes: the host-memory price of asynchronous
saves.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from plait.core.dcp_planner import ChunkedValue
from plait.core.state_chunks import TensorChunk, TensorPieces


class HostStaging:
    """Reusable host buffers, one per tensor chunk of the state dict, keyed by (key, chunk)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state` that shares no storage with it; returns once the copy is complete.

        The caller must not stage again while a write of the previous result is in flight: the
        buffers are reused.
        """
        staged: dict[str, Any] = {}
        devices: set[torch.device] = set()
        for key, value in state.items():
            if isinstance(value, ChunkedValue):
                staged[key] = ChunkedValue(self._stage_pieces(key, value.pieces, devices))
            else:
                staged[key] = copy.deepcopy(value)
        for device in devices:
            # The copies were queued without blocking; the buffers are complete only after this.
            torch.cuda.current_stream(device).synchronize()
        return staged

    def _stage_pieces(
        self, key: str, pieces: TensorPieces, devices: set[torch.device]
    ) -> TensorPieces:
        chunks = []
        for index, chunk in enumerate(pieces.chunks):
            source = chunk.tensor.detach()
            buffer = self._buffer(key, index, source)
            on_cuda = source.device.type == "cuda"
            buffer.copy_(source, non_blocking=on_cuda)
            if on_cuda:
                devices.add(source.device)
            chunks.append(TensorChunk(chunk.offsets, buffer))
        return TensorPieces(pieces.global_shape, chunks)

    def _buffer(self, key: str, index: int, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get((key, index))
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            # Pinned (page-locked) memory only pays where a device copies into it.
            pin = source.device.type == "cuda"
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            self._buffers[(key, index)] = buffer
        return buffer
