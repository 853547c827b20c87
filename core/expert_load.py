"""Expert load of a mixture-of-experts model: tokens routed to each expert, per layer and step.

The record is shared by whoever counts it (the expert-parallel runtime, after the optimizer
step, with the counts summed over the data-parallel ranks) and whoever reports it (the
telemetry plugin, at the end of the step). Neither imports the other: the runtime publishes the
step's counts on `BOARD` and the reporter takes them. Counts are published as tensors and turned
into integers only when taken, so publishing costs the training thread no device sync.
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


class ExpertLoadBoard:
    """The last step's counts, published by the counter and taken (once) by the reporter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[tuple[str, ...], torch.Tensor, torch.Tensor | None] | None = None

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
        with self._lock:
            self._pending = (
                tuple(layers),
                tokens.detach().clone(),
                None if dropped is None else dropped.detach().clone(),
            )

    def take(self) -> ExpertLoad | None:
        """The counts published since the last take, as integers; None if none were."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        names, tokens, dropped = pending
        rows = tokens.round().long().tolist()
        drops = dropped.round().long().tolist() if dropped is not None else [0] * len(names)
        return ExpertLoad(
            tuple(
                LayerLoad(name, tuple(row), drop)
                for name, row, drop in zip(names, rows, drops, strict=True)
            )
        )


# The process's board: one training job per process publishes here.
BOARD = ExpertLoadBoard()
