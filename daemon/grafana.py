"""A Grafana dashboard over the daemon's Prometheus metrics (`plait grafana-dashboard`).

The dashboard is built from one list of panel specs, a row per question family; each panel
answers one question. Every expression names metrics exactly as `/metrics` exports them
(`plait.daemon.exporters.prometheus_name`); a test scrapes a live daemon and fails if a name
here is not among them. Import: Grafana → Dashboards → New → Import, paste or upload the JSON,
pick a Prometheus data source that scrapes the daemons' `--prometheus` endpoints.

    from plait.daemon.grafana import dashboard
    json.dump(dashboard(), open("plait.json", "w"))

Plain data and `json` only: no Grafana SDK is imported (grafanalib and grafana-foundation-sdk
exist, but a dependency for one file of dicts is more than it saves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
GRID_WIDTH = 24
DASHBOARD_UID = "plait-daemon"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Selectors the panels share: the job and rank variables, and the daemon (scrape target).
JOB = 'plait_job_id=~"$job"'
RANK = f'{JOB}, plait_rank=~"$rank"'
INSTANCE = 'instance=~"$instance"'
RANK_LEGEND = "{{plait_job_id}} rank {{plait_rank}}"
GPU_LEGEND = "{{instance}} {{hw_id}}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """One PromQL target: `instant` for stats, bar gauges and tables (the latest value)."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Panel:
    """One question, one panel. `kind`: timeseries, stat, bargauge or table."""

    title: str
    question: str  # the panel's description: what it answers and how to read it
    kind: str
    queries: tuple[Query, ...]
    unit: str = "short"
    width: int = 12
    height: int = 8
    stacked: bool = False
    # Values at or above this turn the panel red (a stat of hangs, a straggler ratio).
    red_from: float | None = None
    repeat: str | None = None  # a variable: one copy of the panel per selected value
    transformations: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _ts(title: str, question: str, *queries: Query, unit: str = "short", **options: Any) -> Panel:
    return Panel(
        title=title, question=question, kind="timeseries", queries=queries, unit=unit, **options
    )


ROWS: tuple[Row, ...] = (
    Row(
        "Throughput and MFU",
        (
            Panel(
                title="Job MFU now",
                question="Model FLOPs/s over the devices' peak, per job (the daemon's window).",
                kind="stat",
                queries=(
                    Query(
                        expr=f"plait_job_mfu_ratio{{{JOB}}}",
                        legend="{{plait_job_id}}",
                        instant=True,
                    ),
                ),
                unit="percentunit",
                width=6,
            ),
            Panel(
                title="Ranks reporting / world size",
                question="Ranks the daemon hears from, against the job's current world size.",
                kind="stat",
                queries=(
                    Query(
                        expr=f"plait_job_ranks_reporting{{{JOB}}}",
                        legend="{{plait_job_id}} reporting",
                        instant=True,
                    ),
                    Query(
                        expr=f"plait_job_world_size{{{JOB}}}",
                        legend="{{plait_job_id}} world",
                        instant=True,
                    ),
                    Query(
                        expr=f"plait_job_restarts{{{JOB}}}",
                        legend="{{plait_job_id}} restarts",
                        instant=True,
                    ),
                ),
                width=6,
            ),
            _ts(
                "MFU per job",
                "Is the job using its devices well, and did that change?",
                Query(expr=f"plait_job_mfu_ratio{{{JOB}}}", legend="{{plait_job_id}}"),
                unit="percentunit",
                width=12,
            ),
            _ts(
                "MFU per rank",
                "Which rank's MFU is lower than the others'?",
                Query(expr=f"plait_rank_mfu_ratio{{{RANK}}}", legend=RANK_LEGEND),
                unit="percentunit",
            ),
            _ts(
                "Tokens per second per job",
                "Training throughput, whole job.",
                Query(expr=f"plait_job_tokens_per_second{{{JOB}}}", legend="{{plait_job_id}}"),
            ),
        ),
    ),
    Row(
        "Where the step goes",
        (
            _ts(
                "Step time breakdown (mean of selected ranks)",
                "Compute, exposed communication, data, pipeline bubble, optimizer and host "
                "overhead, stacked: their sum is the step time.",
                Query(
                    expr="avg by (plait_bottleneck_class) "
                    f"(plait_rank_bottleneck_seconds{{{RANK}}})",
                    legend="{{plait_bottleneck_class}}",
                ),
                unit="s",
                stacked=True,
            ),
            Panel(
                title="Step time breakdown per rank now",
                question="Seconds per step by class, one row per rank.",
                kind="table",
                queries=(Query(expr=f"plait_rank_bottleneck_seconds{{{RANK}}}", instant=True),),
                unit="s",
                transformations=(
                    {
                        "id": "groupingToMatrix",
                        "options": {
                            "rowField": "plait_rank",
                            "columnField": "plait_bottleneck_class",
                            "valueField": "Value",
                        },
                    },
                ),
            ),
            _ts(
                "Step time breakdown, rank $rank",
                "The same stack for one rank (one panel per selected rank).",
                Query(
                    expr=f'plait_rank_bottleneck_seconds{{{JOB}, plait_rank="$rank"}}',
                    legend="{{plait_bottleneck_class}}",
                ),
                unit="s",
                stacked=True,
                width=8,
                repeat="rank",
            ),
        ),
    ),
    Row(
        "Stragglers",
        (
            _ts(
                "Step time per rank against the job's median",
                "A rank above the dashed median line is slower than its peers.",
                Query(expr=f"plait_rank_step_duration_seconds{{{RANK}}}", legend=RANK_LEGEND),
                Query(
                    expr="quantile by (plait_job_id) (0.5, "
                    f"plait_rank_step_duration_seconds{{{JOB}}})",
                    legend="{{plait_job_id}} median",
                ),
                unit="s",
            ),
            _ts(
                "Step time ÷ median per rank",
                "1 is the median; 1.2 means 20 % slower than the job's typical rank.",
                Query(
                    expr=f"plait_rank_step_duration_seconds{{{RANK}}} / on (plait_job_id) "
                    "group_left () quantile by (plait_job_id) (0.5, "
                    f"plait_rank_step_duration_seconds{{{JOB}}})",
                    legend=RANK_LEGEND,
                ),
                red_from=1.2,
            ),
            Panel(
                title="Straggler score per rank now",
                question="The daemon's straggler score (how far a rank's step and compute "
                "times are above the median); highest first.",
                kind="bargauge",
                queries=(
                    Query(
                        expr=f"sort_desc(plait_rank_straggler_score_ratio{{{RANK}}})",
                        legend=RANK_LEGEND,
                        instant=True,
                    ),
                ),
                unit="percentunit",
                width=24,
                height=6,
                red_from=0.2,
            ),
        ),
    ),
    Row(
        "Hangs",
        (
            Panel(
                title="Collectives hung now",
                question="Collectives some ranks entered and others did not; `plait bottleneck` "
                "names the group, op and sequence number.",
                kind="stat",
                queries=(
                    Query(
                        expr=f"sum(plait_collective_hangs{{{INSTANCE}}})",
                        legend="hangs",
                        instant=True,
                    ),
                ),
                width=6,
                red_from=1,
            ),
            Panel(
                title="Stale ranks now",
                question="Ranks that stopped reporting (a hang, a crash, a lost node).",
                kind="stat",
                queries=(
                    Query(
                        expr=f"plait_job_ranks_stale{{{JOB}}}",
                        legend="{{plait_job_id}}",
                        instant=True,
                    ),
                ),
                width=6,
                red_from=1,
            ),
            _ts(
                "Hangs over time per daemon",
                "When did a collective stop, and on which node's daemon?",
                Query(expr=f"plait_collective_hangs{{{INSTANCE}}}", legend="{{instance}}"),
            ),
        ),
    ),
    Row(
        "Communication",
        (
            _ts(
                "Bytes sent per rank by link class",
                "Intra-node against inter-node traffic: inter-node bytes are the slow ones.",
                Query(
                    expr=f"rate(plait_rank_comm_bytes_total{{{RANK}}}[$__rate_interval])",
                    legend=RANK_LEGEND + " {{plait_comm_link}}",
                ),
                unit="Bps",
            ),
            _ts(
                "Bytes sent per job by link class",
                "The job's whole traffic, stacked by link class.",
                Query(
                    expr="sum by (plait_job_id, plait_comm_link) "
                    f"(rate(plait_job_comm_bytes_total{{{JOB}}}[$__rate_interval]))",
                    legend="{{plait_job_id}} {{plait_comm_link}}",
                ),
                unit="Bps",
                stacked=True,
            ),
        ),
    ),
    Row(
        "Mixture of experts (where present)",
        (
            _ts(
                "Expert load imbalance per layer",
                "Busiest expert's tokens over the mean: 1 is balanced.",
                Query(
                    expr=f"plait_moe_expert_imbalance_ratio{{{JOB}}}",
                    legend="{{plait_job_id}} {{plait_moe_layer}}",
                ),
                red_from=2,
            ),
            _ts(
                "Tokens dropped over capacity per layer",
                "Assignments the router dropped in the window (capacity factor too low).",
                Query(
                    expr=f"plait_moe_tokens_dropped{{{JOB}}}",
                    legend="{{plait_job_id}} {{plait_moe_layer}}",
                ),
            ),
        ),
    ),
    Row(
        "GPUs (NVML collector)",
        (
            _ts(
                "GPU utilization",
                "Share of time a kernel ran, per GPU.",
                Query(expr=f"hw_gpu_utilization_ratio{{{INSTANCE}}}", legend=GPU_LEGEND),
                unit="percentunit",
                width=8,
            ),
            _ts(
                "GPU memory used",
                "Device memory in use against the device's total.",
                Query(expr=f"hw_gpu_memory_usage_bytes{{{INSTANCE}}}", legend=GPU_LEGEND + " used"),
                Query(
                    expr=f"hw_gpu_memory_limit_bytes{{{INSTANCE}}}", legend=GPU_LEGEND + " total"
                ),
                unit="bytes",
                width=8,
            ),
            _ts(
                "GPU power",
                "Board power draw.",
                Query(expr=f"hw_power_watts{{{INSTANCE}}}", legend=GPU_LEGEND),
                unit="watt",
                width=8,
            ),
            _ts(
                "SM clock",
                "A clock below its usual value with a throttle reason set is a slowed GPU.",
                Query(expr=f"plait_gpu_sm_clock_hertz{{{INSTANCE}}}", legend=GPU_LEGEND),
                unit="hertz",
                width=8,
            ),
            Panel(
                title="Throttle reasons now",
                question="GPUs held back, and why (power cap, thermal, hardware slowdown).",
                kind="table",
                queries=(
                    Query(expr=f"plait_gpu_throttle_reason{{{INSTANCE}}} == 1", instant=True),
                    Query(expr=f"plait_gpu_throttled{{{INSTANCE}}}", instant=True),
                ),
                width=8,
            ),
            _ts(
                "PCIe and NVLink throughput",
                "Bytes per second per GPU and direction over each link.",
                Query(
                    expr=f"plait_gpu_pcie_throughput_bytes_per_second{{{INSTANCE}}}",
                    legend=GPU_LEGEND + " pcie {{network_io_direction}}",
                ),
                Query(
                    expr=f"plait_gpu_nvlink_throughput_bytes_per_second{{{INSTANCE}}}",
                    legend=GPU_LEGEND + " nvlink {{network_io_direction}}",
                ),
                unit="Bps",
                width=8,
            ),
            Panel(
                title="XID errors in range",
                question="GPU XID errors the driver reported in the dashboard's time range.",
                kind="stat",
                queries=(
                    Query(
                        expr="sum(increase("
                        f'hw_errors_total{{{INSTANCE}, error_type="xid"}}[$__range]))',
                        legend="xid",
                        instant=True,
                    ),
                ),
                width=6,
                red_from=1,
            ),
            _ts(
                "GPU energy per second",
                "Energy counter's rate: average power over the interval.",
                Query(
                    expr=f"rate(hw_energy_joules_total{{{INSTANCE}}}[$__rate_interval])",
                    legend=GPU_LEGEND,
                ),
                unit="watt",
                width=6,
            ),
            _ts(
                "GPU memory utilization",
                "Share of time device memory was read or written.",
                Query(expr=f"hw_gpu_memory_utilization_ratio{{{INSTANCE}}}", legend=GPU_LEGEND),
                unit="percentunit",
            ),
        ),
    ),
    Row(
        "Hosts (host collector)",
        (
            _ts(
                "CPU utilization per node",
                "Share of the node's cores busy: a node near 1 starves its data loaders.",
                Query(expr=f"system_cpu_utilization_ratio{{{INSTANCE}}}", legend="{{host_name}}"),
                unit="percentunit",
            ),
            _ts(
                "Memory used per node",
                "Host memory in use against the node's total.",
                Query(expr=f"system_memory_usage_bytes{{{INSTANCE}}}", legend="{{host_name}} used"),
                Query(
                    expr=f"system_memory_limit_bytes{{{INSTANCE}}}", legend="{{host_name}} total"
                ),
                unit="bytes",
            ),
            _ts(
                "Network bytes per second per node",
                "Host network traffic by direction (all interfaces).",
                Query(
                    expr=f"rate(system_network_io_bytes_total{{{INSTANCE}}}[$__rate_interval])",
                    legend="{{host_name}} {{network_io_direction}}",
                ),
                unit="Bps",
            ),
            _ts(
                "CPU utilization per rank process",
                "Each local rank's share of its node's cores.",
                Query(expr=f"process_cpu_utilization_ratio{{{RANK}}}", legend=RANK_LEGEND),
                unit="percentunit",
            ),
            _ts(
                "Resident memory per rank process",
                "Each local rank's host memory: a steady climb is a leak.",
                Query(expr=f"process_memory_usage_bytes{{{RANK}}}", legend=RANK_LEGEND),
                unit="bytes",
            ),
        ),
    ),
    Row(
        "Daemon",
        (
            _ts(
                "Spans received, dropped and rejected per second",
                "Is the daemon keeping up with the ranks, and is any input refused at the door?",
                Query(
                    expr=f"rate(plait_daemon_spans_received_total{{{INSTANCE}}}[$__rate_interval])",
                    legend="{{instance}} received",
                ),
                Query(
                    expr=f"rate(plait_daemon_spans_dropped_total{{{INSTANCE}}}[$__rate_interval])",
                    legend="{{instance}} dropped",
                ),
                Query(
                    expr=f"rate(plait_daemon_spans_rejected_total{{{INSTANCE}}}[$__rate_interval])",
                    legend="{{instance}} rejected",
                ),
                unit="reqps",
                width=24,
            ),
        ),
    ),
)


def _variables() -> list[dict[str, Any]]:
    def query_variable(name: str, label: str, query: str, sort: int) -> dict[str, Any]:
        return {
            "type": "query",
            "name": name,
            "label": label,
            "datasource": DATASOURCE,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-variable"},
            "refresh": 2,  # on time range change: jobs come and go
            "multi": True,
            "includeAll": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": sort,
        }

    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        # world_size is published for every job; MFU is not under a calibration error.
        query_variable("job", "Job", "label_values(plait_job_world_size, plait_job_id)", 1),
        query_variable(
            "rank",
            "Rank",
            f"label_values(plait_rank_step_duration_seconds{{{JOB}}}, plait_rank)",
            3,  # numerically: rank 10 after rank 9
        ),
        # One hangs figure per daemon: its scrape targets are the daemons.
        query_variable("instance", "Daemon", "label_values(plait_collective_hangs, instance)", 1),
    ]


def _field_config(panel: Panel) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if panel.red_from is not None:
        steps.append({"color": "red", "value": panel.red_from})
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "palette-classic" if panel.kind == "timeseries" else "thresholds"},
    }
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 60 if panel.stacked else 0,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if panel.red_from is not None else "off"},
        }
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "timeseries":
        return {
            "legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel.kind == "stat":
        return {"reduceOptions": reduce, "colorMode": "value", "graphMode": "area"}
    if panel.kind == "bargauge":
        return {"reduceOptions": reduce, "orientation": "horizontal", "displayMode": "gradient"}
    return {"showHeader": True}


def _panel_json(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "expr": query.expr,
            "legendFormat": query.legend or "__auto",
            "instant": query.instant,
            "range": not query.instant,
            "format": "table" if panel.kind == "table" else "time_series",
        }
        for i, query in enumerate(panel.queries)
    ]
    out: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.question,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "targets": targets,
        "fieldConfig": _field_config(panel),
        "options": _options(panel),
    }
    if panel.transformations:
        out["transformations"] = list(panel.transformations)
    if panel.repeat is not None:
        out.update(repeat=panel.repeat, repeatDirection="h", maxPerRow=3)
    return out


def dashboard(title: str = "plait") -> dict[str, Any]:
    """The dashboard as Grafana's JSON model: rows laid out top to bottom, panels left to right."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:  # wrap to a new line under the tallest panel
                x, y, line_height = 0, y + line_height, 0
            grid = {"x": x, "y": y, "w": panel.width, "h": panel.height}
            panels.append(_panel_json(panel, next_id, grid))
            next_id, x = next_id + 1, x + panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "uid": DASHBOARD_UID,
        "title": title,
        "description": "Live MFU, step breakdown, stragglers, hangs, link bytes, expert load "
        "and GPUs from the plait node daemons' Prometheus endpoints.",
        "tags": ["plait", "training"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair: one moment across every panel
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "browser",
        "templating": {"list": _variables()},
        "annotations": {"list": []},
        "panels": panels,
    }
