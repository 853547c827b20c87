"""Telemetry plugin: OpenTelemetry spans and metrics for steps, phases and every comm op.

The engine registers it under the name "telemetry" when `telemetry.enabled` is set, calling
`make_plugin()` so each engine gets its own state (providers, in-flight op records).
"""

from __future__ import annotations

from plait.plugins.telemetry.plugin import TelemetryPlugin, comm_attributes

__all__ = ["TelemetryPlugin", "comm_attributes", "make_plugin"]


def make_plugin() -> TelemetryPlugin:
    """A fresh plugin object for one engine."""
    return TelemetryPlugin()
