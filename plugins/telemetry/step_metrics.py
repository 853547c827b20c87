"""The step metrics a rank exports (tokens, model FLOPs, step time, data wait, loss, device
memory), recorded by the span exporter's thread, never the training thread."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from plait.daemon import telemetry_schema as schema

if TYPE_CHECKING:
    from plait.core.step import StepReport


class StepMetrics:
    """The instruments of one rank's meter."""

    def __init__(self, meter: Meter, device: str) -> None:
        self.device = device
        # Job-wide figures: every rank reports the same value for a step (aggregate with max).
        self.tokens = meter.create_counter(
            schema.METRIC_JOB_TOKENS,
            unit=schema.UNIT_TOKEN,
            description="tokens processed by the whole job",
        )
        self.model_flops = meter.create_counter(
            schema.METRIC_JOB_MODEL_FLOPS,
            unit=schema.UNIT_FLOP,
            description="training FLOPs of the whole job",
        )
        self.step_duration = meter.create_histogram(
            schema.METRIC_STEP_DURATION,
            unit=schema.UNIT_SECONDS,
            description="optimizer step wall time on this rank",
        )
        self.data_wait = meter.create_histogram(
            schema.METRIC_DATA_WAIT,
            unit=schema.UNIT_SECONDS,
            description="time this rank waited for its batch",
        )
        self.loss = meter.create_gauge(
            schema.METRIC_TRAIN_LOSS, description="last step's mean loss"
        )
        if device.startswith("cuda"):
            meter.create_observable_gauge(
                schema.METRIC_DEVICE_MEMORY_USED,
                callbacks=[self._observe_device_memory],
                unit=schema.UNIT_BYTES,
                description="bytes allocated by torch on this rank's device",
            )

    def record(self, report: StepReport) -> None:
        self.tokens.add(report.tokens)
        self.model_flops.add(float(report.model_flops))
        self.step_duration.record(report.step_seconds)
        self.data_wait.record(report.data_wait_seconds)
        if math.isfinite(report.loss):  # the SDK refuses NaN/inf with a log line per step
            self.loss.set(report.loss)

    def _observe_device_memory(self, options: CallbackOptions) -> list[Observation]:
        import torch

        return [Observation(torch.cuda.memory_allocated(self.device))]
