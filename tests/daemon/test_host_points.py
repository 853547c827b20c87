"""The host collector's figures as published points: OpenTelemetry's system and process names,
utilizations as ratios of the node, byte counters per direction, one series per local rank."""

from __future__ import annotations

from plait.daemon import telemetry_schema as schema
from plait.daemon.exporters import prometheus_name
from plait.daemon.host import HostSample, ProcessSample
from plait.daemon.points import host_points


def _sample() -> HostSample:
    return HostSample(
        hostname="node-a",
        cpu_percent=50.0,
        cpu_count=8,
        memory_used_bytes=3 << 30,
        memory_total_bytes=16 << 30,
        net_bytes_sent=1000,
        net_bytes_recv=7000,
        net_sent_bytes_per_second=10.0,
        net_recv_bytes_per_second=70.0,
        sampled_ns=1,
        processes={
            ("job", -1, 1): ProcessSample(cpu_percent=200.0, rss_bytes=5 << 20),
            ("job", -1, 0): ProcessSample(cpu_percent=100.0, rss_bytes=4 << 20),
        },
    )


def test_host_points_are_ratios_of_the_node_and_bytes() -> None:
    points = host_points(_sample())
    by_key = {
        (
            p.name,
            p.attributes.get(schema.RESOURCE_RANK),
            p.attributes.get("network.io.direction"),
        ): p
        for p in points
    }
    assert by_key[("system.cpu.utilization", None, None)].value == 0.5
    assert by_key[("system.memory.usage", None, None)].value == 3 << 30
    assert by_key[("system.memory.limit", None, None)].value == 16 << 30
    sent = by_key[("system.network.io", None, "transmit")]
    assert (sent.value, sent.counter) == (1000, True)
    assert by_key[("system.network.io", None, "receive")].value == 7000
    # 200 % of one core on an 8-core node is a quarter of the node.
    assert by_key[("process.cpu.utilization", 1, None)].value == 0.25
    assert by_key[("process.cpu.utilization", 0, None)].value == 0.125
    assert by_key[("process.memory.usage", 0, None)].value == 4 << 20
    rank_attrs = by_key[("process.memory.usage", 1, None)].attributes
    assert rank_attrs == {
        schema.RESOURCE_JOB_ID: "job",
        schema.RESOURCE_RANK: 1,
        schema.RESOURCE_HOST_NAME: "node-a",
    }
    assert all(p.attributes[schema.RESOURCE_HOST_NAME] == "node-a" for p in points)


def test_host_points_have_prometheus_names_with_units() -> None:
    names = {prometheus_name(p.name, p.unit, p.counter) for p in host_points(_sample())}
    assert names == {
        "system_cpu_utilization_ratio",
        "system_memory_usage_bytes",
        "system_memory_limit_bytes",
        "system_network_io_bytes",  # prometheus-client adds `_total` to the counter's samples
        "process_cpu_utilization_ratio",
        "process_memory_usage_bytes",
    }
