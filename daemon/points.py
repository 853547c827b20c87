"""The flat list of figures (`DaemonPoint`s) the OTLP and Prometheus exporters publish.

Built from the analysis layer's records (`plait.daemon.analysis`), the same ones the RPCs
translate, so a scrape, an upstream export and `plait top` report the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.daemon import mfu
from plait.daemon import telemetry_schema as schema
from plait.daemon.analysis import DEFAULT_METRICS_WINDOW_STEPS, RANK_ENDED, RANK_LIVE
from plait.daemon.bottleneck import CLASSES
from plait.daemon.exporters import DaemonPoint
from plait.daemon.host import HostSample
from plait.daemon.nvml import metric_points

if TYPE_CHECKING:
    from plait.daemon.service import DaemonService

GAUGE_COUNTERS = frozenset({"hw.energy", "hw.errors"})
# The link-class label of the comm byte counters, and its values.
LINK_LABEL = "plait.comm.link"
LINK_INTRA_NODE = "intra_node"
LINK_INTER_NODE = "inter_node"
NETWORK_DIRECTION_LABEL = "network.io.direction"


def _rank_attributes(
    job_id: str, rank: int, host: str, replica_group: int = schema.NO_REPLICA_GROUP
) -> dict[str, object]:
    attributes: dict[str, object] = {
        schema.RESOURCE_JOB_ID: job_id,
        schema.RESOURCE_RANK: rank,
        schema.RESOURCE_HOST_NAME: host,
    }
    if replica_group != schema.NO_REPLICA_GROUP:
        # Each replica group numbers its ranks from 0: without it two groups' series are one.
        attributes[schema.RESOURCE_REPLICA_GROUP] = replica_group
    return attributes


def host_points(host: HostSample) -> list[DaemonPoint]:
    """The node's CPU, memory and network, and each local rank process's CPU and memory."""
    node = {schema.RESOURCE_HOST_NAME: host.hostname}
    points = [
        DaemonPoint("system.cpu.utilization", host.cpu_percent / 100, node),
        DaemonPoint("system.memory.usage", host.memory_used_bytes, node),
        DaemonPoint("system.memory.limit", host.memory_total_bytes, node),
    ]
    for direction, total in (("transmit", host.net_bytes_sent), ("receive", host.net_bytes_recv)):
        attrs = {**node, NETWORK_DIRECTION_LABEL: direction}
        points.append(DaemonPoint("system.network.io", total, attrs, counter=True))
    # psutil gives a process's CPU as a percent of one core; the convention divides by the
    # node's cores, so a rank using every core reads 1.
    cores = max(host.cpu_count, 1)
    for (job_id, replica_group, rank), process in sorted(host.processes.items()):
        attrs = _rank_attributes(job_id, rank, host.hostname, replica_group)
        utilization = process.cpu_percent / 100 / cores
        points.append(DaemonPoint("process.cpu.utilization", utilization, attrs))
        points.append(DaemonPoint("process.memory.usage", process.rss_bytes, attrs))
    return points


def daemon_points(
    service: DaemonService, window_steps: int = DEFAULT_METRICS_WINDOW_STEPS
) -> list[DaemonPoint]:
    """Every figure the exporters publish, computed now (finished jobs left out)."""
    points: list[DaemonPoint] = []
    nvml = service.extras.nvml
    if nvml is not None:
        points.extend(
            DaemonPoint(name, value, attrs, counter=name in GAUGE_COUNTERS)
            for name, value, attrs in metric_points(nvml.latest)
        )
    points.extend(host_points(service.host.latest))
    metrics = service.metrics_view(window_steps=window_steps)
    job_totals: dict[tuple[str, str], int] = {}
    for r in metrics.ranks:
        attrs = _rank_attributes(r.job_id, r.rank, r.host, r.replica_group)
        if r.status not in (RANK_LIVE, RANK_ENDED):
            continue  # a stale or superseded rank's last figures would read as current
        if not mfu.is_calibration_error(r.mfu):  # a wrong peak publishes no MFU at all
            points.append(DaemonPoint("plait.rank.mfu", r.mfu, attrs))
        points.append(DaemonPoint("plait.rank.step.duration", r.step_seconds, attrs))
        points.append(DaemonPoint("plait.rank.tokens_per_second", r.tokens_per_second, attrs))
        for link, total in (
            (LINK_INTRA_NODE, r.comm_bytes_intra_node_total),
            (LINK_INTER_NODE, r.comm_bytes_inter_node_total),
        ):
            link_attrs = {**attrs, LINK_LABEL: link}
            points.append(DaemonPoint("plait.rank.comm.bytes", total, link_attrs, counter=True))
            job_totals[(r.job_id, link)] = job_totals.get((r.job_id, link), 0) + total
    for j in metrics.jobs:
        attrs = {schema.RESOURCE_JOB_ID: j.job_id}
        if not mfu.is_calibration_error(j.mfu):
            points.append(DaemonPoint("plait.job.mfu", j.mfu, attrs))
        points.append(DaemonPoint("plait.job.tokens_per_second", j.tokens_per_second, attrs))
        points.append(DaemonPoint("plait.job.flops.achieved", j.model_flops_per_second, attrs))
        points.append(DaemonPoint("plait.job.flops.peak", j.peak_flops, attrs))
        points.append(DaemonPoint("plait.job.step.duration", j.step_seconds, attrs))
        points.append(DaemonPoint("plait.job.ranks.reporting", j.ranks_reporting, attrs))
        points.append(DaemonPoint("plait.job.ranks.stale", j.ranks_stale, attrs))
        points.append(DaemonPoint("plait.job.world.size", j.world.current_size, attrs))
        points.append(DaemonPoint("plait.job.restarts", j.world.restarts, attrs))
        for link in (LINK_INTRA_NODE, LINK_INTER_NODE):
            total = job_totals.get((j.job_id, link), 0)
            link_attrs = {**attrs, LINK_LABEL: link}
            points.append(DaemonPoint("plait.job.comm.bytes", total, link_attrs, counter=True))
        for layer in j.expert_load:
            layer_attrs = {**attrs, schema.SPAN_MOE_LAYER: layer.layer}
            points.append(DaemonPoint("plait.moe.expert.imbalance", layer.imbalance, layer_attrs))
            points.append(DaemonPoint("plait.moe.tokens.dropped", layer.dropped, layer_attrs))
    bottleneck = service.bottleneck_view(window_steps=window_steps)
    for a in bottleneck.ranks:
        attrs = _rank_attributes(a.job_id, a.rank, a.host, a.replica_group)
        for name in CLASSES:
            points.append(
                DaemonPoint(
                    "plait.rank.bottleneck.seconds",
                    a.breakdown.seconds[name],
                    {**attrs, "plait.bottleneck.class": name},
                )
            )
    for score in bottleneck.stragglers:
        t = score.timing
        attrs = _rank_attributes(t.job_id, t.rank, t.host, t.replica_group)
        points.append(DaemonPoint("plait.rank.straggler.score", score.score, attrs))
    points.append(DaemonPoint("plait.collective.hangs", float(len(service.hangs()))))
    store = service.store
    with store.lock:
        counts = (store.spans_received, store.spans_dropped, store.metric_points_dropped)
        rejects = (store.rejected.spans, store.rejected.metric_points)
    points.append(DaemonPoint("plait.daemon.spans.received", counts[0], counter=True))
    forwarder = service.extras.forwarder_stats() if service.extras.forwarder_stats else None
    forward_spans = forwarder.dropped_spans if forwarder else 0
    forward_points = forwarder.dropped_metric_points if forwarder else 0
    points.append(
        DaemonPoint("plait.daemon.spans.dropped", counts[1] + forward_spans, counter=True)
    )
    points.append(
        DaemonPoint("plait.daemon.metric_points.dropped", counts[2] + forward_points, counter=True)
    )
    # Rejects by reason; the totals are the sums over `reason`.
    points.append(DaemonPoint("plait.daemon.spans.rejected", rejects[0], counter=True))
    points.append(DaemonPoint("plait.daemon.metric_points.rejected", rejects[1], counter=True))
    if forwarder is not None:
        for reason, count in sorted(forwarder.dropped_by_reason.items()):
            points.append(
                DaemonPoint("plait.daemon.forward.dropped", count, {"reason": reason}, True)
            )
        points.append(DaemonPoint("plait.daemon.forward.queued", forwarder.queued_bytes))
    points.append(
        DaemonPoint("plait.daemon.calls.rejected", service.extras.counters.total, counter=True)
    )
    return points
