"""The Grafana dashboard: every name it queries is one a live daemon exports, and the JSON
holds what Grafana needs to import it (ids, layout, targets, the data source variable)."""

from __future__ import annotations

import copy
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from plait.core.host import host_name
from plait.daemon import telemetry_schema as schema
from plait.daemon.grafana import SCHEMA_VERSION, dashboard
from plait.daemon.nvml import NvmlCollector
from plait.daemon.server import DaemonServer
from plait.tools.cli import app
from tests.daemon.otlp_inputs import STEP_NS, SpanSpec, rank_resource, step_spans, trace_request
from tests.daemon.promql_names import Names, names, variable_names
from tests.daemon.test_daemon_nvml import fake_pynvml

STEPS = 6
# Labels Prometheus adds to every series it scrapes (the target), not the daemon.
TARGET_LABELS = frozenset({"instance", "job"})
PANEL_KINDS = frozenset({"timeseries", "stat", "bargauge", "table"})


@dataclass(frozen=True, slots=True)
class Exported:
    metrics: frozenset[str]  # sample names, counters with `_total`
    labels: frozenset[str]


def _rank_spans(base_ns: int) -> list[SpanSpec]:
    """Steps with a forward phase, an all-reduce across both link classes and MoE load."""
    spans = step_spans(0, STEPS, base_ns)
    for step in range(STEPS):
        start = base_ns + step * STEP_NS
        comm = {
            schema.SPAN_STEP: step,
            schema.SPAN_COMM_OP: "all_reduce",
            schema.SPAN_COMM_GROUP: "dp",
            schema.SPAN_COMM_GROUP_RANKS: [0, 1],
            schema.SPAN_COMM_SEQ: step,
            schema.SPAN_COMM_BYTES: 4096,
            schema.SPAN_COMM_PURPOSE: "grad_bucket",
            schema.SPAN_COMM_ALGORITHM: schema.COMM_ALGORITHM_BACKEND,
            schema.SPAN_COMM_BYTES_INTRA_NODE: 1024,
            schema.SPAN_COMM_BYTES_INTER_NODE: 2048,
        }
        spans.append(SpanSpec("all_reduce", start + STEP_NS // 2, start + STEP_NS * 3 // 4, comm))
        moe = {
            schema.SPAN_STEP: step,
            schema.SPAN_MOE_LAYER: "layers.0.moe",
            schema.SPAN_MOE_TOKENS_PER_EXPERT: [10, 30],
            schema.SPAN_MOE_DROPPED: 2,
        }
        spans.append(SpanSpec(schema.EXPERT_LOAD_SPAN_NAME, start, start + 1000, moe))
    return spans


def _wait_for_rank_processes(server: DaemonServer, ranks: set[tuple[str, int, int]]) -> None:
    """Until a host sample holds the ranks' processes (the collector's thread takes it)."""
    deadline = time.monotonic() + 30
    while not ranks <= set(server.host.latest.processes):
        assert time.monotonic() < deadline, "the host collector never sampled the ranks"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def exported() -> Iterator[Exported]:
    """What `/metrics` of a daemon with a GPU and a two-rank MoE job serves."""
    server = DaemonServer(
        "127.0.0.1:0",
        host_interval=0.2,
        prometheus="127.0.0.1:0",
        nvml=NvmlCollector(nvml=fake_pynvml(gpus=1)),
    ).start()
    try:
        base = time.time_ns() - 10**9
        with grpc.insecure_channel(server.address) as channel:
            traces = trace_service_pb2_grpc.TraceServiceStub(channel)
            for rank in (0, 1):
                # This process stands for both ranks, on this host: the host collector samples it.
                resource = rank_resource(
                    "dash",
                    rank,
                    **{
                        schema.RESOURCE_HOST_NAME: host_name(),
                        schema.RESOURCE_PROCESS_PID: os.getpid(),
                    },
                )
                request = trace_request(resource, _rank_spans(base))
                assert not traces.Export(request, timeout=10).HasField("partial_success")
        _wait_for_rank_processes(server, {("dash", -1, 0), ("dash", -1, 1)})
        assert server.prometheus is not None
        url = f"http://{server.prometheus.address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop(grace=0.5)
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    yield Exported(
        metrics=frozenset(s.name for s in samples),
        labels=frozenset(label for s in samples for label in s.labels),
    )


def _queries(board: dict[str, Any]) -> Iterator[tuple[str, Names]]:
    """(where, names) for every panel target and every query variable."""
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", names(target["expr"])
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']!r}", variable_names(variable["definition"])


def unknown_names(board: dict[str, Any], exported: Exported) -> list[str]:
    problems = []
    for where, found in _queries(board):
        problems += [f"{where}: metric {m}" for m in sorted(found.metrics - exported.metrics)]
        labels = found.labels - exported.labels - TARGET_LABELS
        problems += [f"{where}: label {label}" for label in sorted(labels)]
    return problems


def test_every_name_the_dashboard_queries_is_exported(exported: Exported) -> None:
    board = dashboard()
    assert unknown_names(board, exported) == []
    used = set().union(*(found.metrics for _, found in _queries(board)))
    # Each family the brief names is on the dashboard: MFU, breakdown, stragglers, hangs,
    # link bytes, expert load, NVML.
    assert {
        "plait_job_mfu_ratio",
        "plait_rank_mfu_ratio",
        "plait_rank_bottleneck_seconds",
        "plait_rank_step_duration_seconds",
        "plait_rank_straggler_score_ratio",
        "plait_collective_hangs",
        "plait_rank_comm_bytes_total",
        "plait_moe_expert_imbalance_ratio",
        "hw_gpu_utilization_ratio",
        "hw_power_watts",
    } <= used


def test_a_renamed_metric_or_label_is_caught(exported: Exported) -> None:
    board = copy.deepcopy(dashboard())
    target = next(p for p in board["panels"] if p["title"] == "MFU per rank")["targets"][0]
    target["expr"] = target["expr"].replace("plait_rank_mfu_ratio", "plait_rank_mfu")
    stale = next(p for p in board["panels"] if p["title"] == "Stale ranks now")["targets"][0]
    stale["expr"] = stale["expr"].replace("plait_job_id", "job_id")
    assert unknown_names(board, exported) == [
        "panel 'MFU per rank' A: metric plait_rank_mfu",
        "panel 'Stale ranks now' A: label job_id",
    ]


def _overlap(a: dict[str, int], b: dict[str, int]) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def test_the_json_holds_what_grafana_needs_to_import_it() -> None:
    board = dashboard()
    assert board["schemaVersion"] == SCHEMA_VERSION >= 39
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    grids = [p["gridPos"] for p in panels]
    for grid in grids:
        assert set(grid) == {"x", "y", "w", "h"} and grid["w"] > 0 and grid["h"] > 0
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
    for i, a in enumerate(grids):
        for b in grids[i + 1 :]:
            assert not _overlap(a, b), (a, b)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "rank"):
        assert variables[name]["type"] == "query"
        assert variables[name]["definition"].startswith("label_values(")
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    for panel in panels:
        if panel["type"] == "row":
            continue  # a heading: it queries nothing
        assert panel["type"] in PANEL_KINDS
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"
        if "repeat" in panel:
            assert panel["repeat"] in variables


def test_the_command_prints_the_dashboard() -> None:
    result = CliRunner().invoke(app, ["grafana-dashboard"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == dashboard()
