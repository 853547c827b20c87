"""Expert load of a mixture-of-experts model: tokens routed to each expert, per layer and step.

The expert-parallel runtime counts them after the optimizer step (summed over the data-parallel
ranks) and publishes the step's counts on the core's span board (`plait.core.span_board`); the
telemetry plugin takes them at the end of the step and sends one `plait.moe.expert_load` span
per layer. Counts are published as tensors and turned into integers only when resolved, on the
telemetry's exporter thread, which waits for an event recorded after the counts were copied to
the host: the training thread never waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.core.span_board import BOARD, PublishedSpan, SpanBoard
from plait.daemon import telemetry_schema as names


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
    published_ns: int = field(default_factory=time.time_ns)

    @property
    def always_sent(self) -> bool:
        return False  # one per step: dropped like the step's own records when telemetry lags

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

    def spans(self, step: int) -> list[PublishedSpan]:
        """One instant span per layer, for the step the telemetry took the counts in (the
        runtime publishes after the optimizer step: the step that just ended)."""
        return [
            PublishedSpan(
                name=names.EXPERT_LOAD_SPAN_NAME,
                start_ns=self.published_ns,
                end_ns=self.published_ns,
                attributes=layer_attributes(step, layer),
            )
            for layer in self.resolve().layers
        ]


def layer_attributes(step: int, layer: LayerLoad) -> dict[str, Any]:
    return {
        names.SPAN_STEP: step,
        names.SPAN_MOE_LAYER: layer.layer,
        names.SPAN_MOE_TOKENS_PER_EXPERT: list(layer.tokens_per_expert),
        names.SPAN_MOE_DROPPED: layer.dropped,
    }


def expert_load_source(
    layers: Sequence[str], tokens: torch.Tensor, dropped: torch.Tensor | None = None
) -> PublishedExpertLoad:
    """One step's counts, copied off the device behind the work that counted them.

    `tokens`: (layers, experts) counts; `dropped`: (layers,) or None when not counted."""
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
    return PublishedExpertLoad(tuple(layers), tokens, dropped, copied)


def publish_expert_load(
    layers: Sequence[str],
    tokens: torch.Tensor,
    dropped: torch.Tensor | None = None,
    *,
    board: SpanBoard = BOARD,
) -> None:
    """Publish one step's counts for the telemetry (nobody taking them: they fall off)."""
    board.publish(expert_load_source(layers, tokens, dropped))
