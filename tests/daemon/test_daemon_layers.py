"""The daemon's layers: the analysis knows no gRPC, the servicer only translates its records."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from plait.daemon import analysis

DAEMON = Path(analysis.__file__).resolve().parent
# Modules of the analysis layer and of the config, and what they may not reach.
PURE = ("analysis", "config", "store", "bottleneck", "stragglers", "hangs", "decoder", "host",
        "control", "control_records", "deliveries", "trace_analysis", "profile_trace",
        "chrome_trace", "quorum_log", "replica_groups", "checkpoint_log", "mfu",
        "telemetry_schema")  # fmt: skip
FORBIDDEN = ("grpc", "google.protobuf", "plait.proto", "opentelemetry")


def imports(module: str) -> set[str]:
    """Modules imported at run time (imports for type checking only do not count)."""
    tree = ast.parse((DAEMON / f"{module}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_analysis_layer_imports_no_grpc_protobuf_or_otel() -> None:
    for module in PURE:
        for name in imports(module):
            assert not name.startswith(FORBIDDEN), f"plait.daemon.{module} imports {name}"
            if name.startswith("plait.daemon."):
                assert name.removeprefix("plait.daemon.") in PURE, (module, name)


def test_the_analysis_returns_dataclasses() -> None:
    for record in (
        analysis.RankFigures,
        analysis.JobFigures,
        analysis.ExpertLayerFigures,
        analysis.RankAnalysis,
        analysis.BottleneckView,
        analysis.MetricsView,
        analysis.JobState,
    ):
        assert dataclasses.is_dataclass(record), record


def test_the_capture_analysis_and_the_control_registry_return_dataclasses() -> None:
    from plait.daemon import control_records, trace_analysis

    for record in (
        trace_analysis.TraceAnalysis,
        trace_analysis.RankTraceFigures,
        trace_analysis.CrossRankSummary,
        control_records.Outcome,
        control_records.EndpointView,
        control_records.Order,
    ):
        assert dataclasses.is_dataclass(record), record


def test_exporter_points_come_from_the_analysis_not_from_responses() -> None:
    used = imports("points")
    assert not any(name.startswith(FORBIDDEN) for name in used), used
    source = (DAEMON / "points.py").read_text()
    assert "_metrics(" not in source and "GetMetrics" not in source
