"""The comm heartbeat: what a rank's hang detection needs while a collective is blocked.

Every `HEARTBEAT_INTERVAL_MS` (or `$PLAIT_HEARTBEAT_INTERVAL_MS`) a small metric reader of its
own publishes the collectives this rank entered and has not finished and the last sequence
number it issued per group; the daemon's hang detector compares them across ranks
(`plait.daemon.hangs`). The source runs on the reader's thread; the training thread only
updates a dict per op.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from plait.daemon import telemetry_schema as schema

HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_ENV = "PLAIT_HEARTBEAT_INTERVAL_MS"

GroupId = tuple[str, tuple[int, ...]]  # (group name, global ranks)


class InflightComm(Protocol):
    """What the heartbeat reports of an op in flight (the telemetry plugin's `CommRecord`)."""

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    seq: int
    purpose: str
    start_ns: int


HeartbeatSource = Callable[[], tuple[Sequence[InflightComm], Mapping[GroupId, int]]]


def start_heartbeat(
    resource: Resource,
    exporter: MetricExporter,
    source: HeartbeatSource,
    *,
    scope: tuple[str, str],
    export_timeout_millis: float,
) -> MeterProvider:
    """A provider publishing `source()` (ops in flight, last seq per group) every interval.

    Separate from the step metrics' provider, so the heartbeat's short interval does not make
    the step metrics export more often. The caller shuts the provider down.
    """
    reader = PeriodicExportingMetricReader(
        exporter,
        export_interval_millis=float(os.environ.get(HEARTBEAT_ENV, HEARTBEAT_INTERVAL_MS)),
        export_timeout_millis=export_timeout_millis,
    )
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    meter = provider.get_meter(*scope)
    snapshot: dict[str, Any] = {}

    def observe_heartbeat(options: CallbackOptions) -> list[Observation]:
        # One snapshot per collection serves all three gauges (heartbeat runs first).
        snapshot["inflight"], snapshot["entered"] = source()
        return [Observation(time.time())]

    def observe_inflight(options: CallbackOptions) -> list[Observation]:
        return [
            Observation(
                op.start_ns / 1e9,
                {
                    schema.SPAN_COMM_GROUP: op.group_name,
                    schema.SPAN_COMM_GROUP_RANKS: list(op.group_ranks),
                    schema.SPAN_COMM_OP: op.op,
                    schema.SPAN_COMM_SEQ: op.seq,
                    schema.SPAN_COMM_PURPOSE: op.purpose,
                },
            )
            for op in snapshot.get("inflight", ())
        ]

    def observe_entered(options: CallbackOptions) -> list[Observation]:
        return [
            Observation(
                seq, {schema.SPAN_COMM_GROUP: name, schema.SPAN_COMM_GROUP_RANKS: list(ranks)}
            )
            for (name, ranks), seq in snapshot.get("entered", {}).items()
        ]

    meter.create_observable_gauge(schema.METRIC_COMM_HEARTBEAT, callbacks=[observe_heartbeat])
    meter.create_observable_gauge(schema.METRIC_COMM_INFLIGHT, callbacks=[observe_inflight])
    meter.create_observable_gauge(schema.METRIC_COMM_ENTERED, callbacks=[observe_entered])
    return provider
