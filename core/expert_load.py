"""Expert load of a mixture-of-experts model: tokens routed to each expert, per layer and step.

The record is shared by whoever counts it (the expert-parallel runtime, after the optimizer
step, with the counts summed over the data-parallel ranks) and whoever reports it (the
telemetry plugin, at the end of the step). Neither imports the other: the runtime publishes the
step's counts on `BOARD` and the reporter takes them. Counts are published as tensors and turned
into integers only when resolved: the telemetry plugin takes the published tensors on the
training thread (`take_published`, no device sync) and resolves them on its exporter thread,
which waits for an event recorded after the counts were copied to the host.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerLoad:
    """One MoE layer in one step: kept assignments per expert and those dropped over capacity."""

    layer: str
    tokens_per_expert: tuple[int, ...]
    dropped: int = 0

    @property
    def imbalance(self) -> float:
        """max / mean tokens per expert (1.0: perfectly balanced; 0.0: no tokens)."""
        total = sum(self.tokens_per_expert)
        if total == 0:
            return 0.0
        return max(self.tokens_per_expert) * len(self.tokens_per_expert) / total


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    layers: tuple[LayerLoad, ...]


@dataclass(frozen=True, slots=True)
class PublishedExpertLoad:
    """One step's counts as published: tensors, possibly on a device, not yet read back."""

    layers: tuple[str, ...]
    tokens: torch.Tensor  # (layers, experts), on the host
    dropped: torch.Tensor | None  # (layers,), or None when not counted
    copied: torch.cuda.Event | None = None  # recorded after device-to-host copies

    def resolve(self) -> ExpertLoad:
        """The counts as integers (waits for the device-to-host copies only; any thread)."""
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.tokens.round().long().tolist()
        drops = (
            self.dropped.round().long().tolist()
            if self.dropped is not None
            else [0] * len(self.layers)
        )
        return ExpertLoad(
            tuple(
                LayerLoad(name, tuple(row), drop)
                for name, row, drop in zip(self.layers, rows, drops, strict=True)
            )
        )


class ExpertLoadBoard:
    """The last step's counts, published by the counter and taken (once) by the reporter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: PublishedExpertLoad | None = None

    def publish(
        self, layers: Sequence[str], tokens: torch.Tensor, dropped: torch.Tensor | None = None
    ) -> None:
        """`tokens`: (layers, experts) counts; `dropped`: (layers,) or None when not counted."""
        if tokens.dim() != 2 or tokens.shape[0] != len(layers):
            raise ValueError(
                f"expert load: tokens must be (layers={len(layers)}, experts), got "
                f"{tuple(tokens.shape)}"
            )
        if dropped is not None and tuple(dropped.shape) != (len(layers),):
            raise ValueError(
                f"expert load: dropped must be ({len(layers)},), got {tuple(dropped.shape)}"
            )
        copied = None
        if tokens.is_cuda:
            # Copied to (pinned) host memory behind the work that counted them; the event says
            # when the copies landed, so the reader waits for them, not for the device.
            tokens = tokens.detach().to("cpu", non_blocking=True)
            dropped = None if dropped is None else dropped.detach().to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            tokens = tokens.detach().clone()
            dropped = None if dropped is None else dropped.detach().clone()
        with self._lock:
            self._pending = PublishedExpertLoad(tuple(layers), tokens, dropped, copied)

    def take_published(self) -> PublishedExpertLoad | None:
        """The counts published since the last take, still as tensors; None if none were."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def take(self) -> ExpertLoad | None:
        """The counts published since the last take, as integers; None if none were."""
        pending = self.take_published()
        return None if pending is None else pending.resolve()


# The process's board: one training job per process publishes here.
BOARD = ExpertLoadBoard()
