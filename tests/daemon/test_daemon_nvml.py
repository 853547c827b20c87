"""The NVML collector against a fake `pynvml` with nvidia-ml-py's function names."""

from __future__ import annotations

import types
from collections import deque
from typing import Any

import grpc
import pytest

from plait.daemon import telemetry_schema
from plait.daemon.nvml import NvmlCollector, metric_points
from plait.daemon.server import DaemonServer
from plait.daemon.service import daemon_points
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def fake_pynvml(gpus: int = 2, *, init_error: Exception | None = None) -> Any:
    """A module with the nvidia-ml-py calls the collector makes; GPU 1 lacks power readings."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVMLError_NotSupported = NVMLError_NotSupported
    m.NVMLError_Timeout = NVMLError_Timeout
    m.NVML_CLOCK_SM = 1
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    m.nvmlEventTypeXidCriticalError = 8
    m.nvmlClocksThrottleReasonSwPowerCap = 4
    m.nvmlClocksThrottleReasonHwSlowdown = 8
    m.nvmlClocksThrottleReasonGpuIdle = 1
    m.calls = []
    m.events = deque()
    m.nvlink_kib = [1000, 2000]

    def init() -> None:
        m.calls.append("init")
        if init_error is not None:
            raise init_error

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h[1]:04d}"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + h[1], memory=10)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=(h[1] + 1) * 2**30, total=80 * 2**30, free=0
    )

    def power(h: tuple[str, int]) -> int:
        if h[1] == 1:
            raise NVMLError_NotSupported("Not Supported")
        return 350_000  # mW

    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: 5_000_000  # mJ
    m.nvmlDeviceGetClockInfo = lambda h, clock: 1980  # MHz
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 4 | 8 if h[1] == 0 else 1
    m.nvmlDeviceGetPcieThroughput = lambda h, counter: 1000 if counter == 0 else 3000  # KB/s

    def field_values(h: tuple[str, int], ids: list[int]) -> list[Any]:
        return [
            types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=m.nvlink_kib[k]))
            for k in range(len(ids))
        ]

    m.nvmlDeviceGetFieldValues = field_values
    m.nvmlEventSetCreate = lambda: "event-set"
    m.nvmlDeviceRegisterEvents = lambda h, types_, event_set: None

    def wait(event_set: str, timeout_ms: int) -> Any:
        if not m.events:
            raise NVMLError_Timeout("Timeout")
        return m.events.popleft()

    m.nvmlEventSetWait_v2 = wait
    m.nvmlEventSetFree = lambda event_set: m.calls.append("free")
    return m


def test_samples_every_gpu_under_semantic_convention_names() -> None:
    nvml = fake_pynvml()
    collector = NvmlCollector(nvml=nvml)
    assert collector.available and collector.status == "nvml: 2 GPU(s)"
    nvml.events.append(types.SimpleNamespace(device=("handle", 1), eventData=79))
    nvml.nvlink_kib = [1000 + 2048, 2000 + 4096]  # counters moved on since the first sample
    gpu0, gpu1 = collector.sample()
    assert gpu0.utilization == pytest.approx(0.40) and gpu1.utilization == pytest.approx(0.41)
    assert gpu0.memory_used_bytes == 2**30 and gpu0.memory_total_bytes == 80 * 2**30
    assert gpu0.power_watts == pytest.approx(350.0) and gpu1.power_watts is None
    assert gpu0.energy_joules == pytest.approx(5000.0)
    assert gpu0.sm_clock_hz == pytest.approx(1.98e9)
    assert gpu0.throttle_reasons == ("sw_power_cap", "hw_slowdown")
    assert gpu1.throttle_reasons == ("gpu_idle",)
    assert gpu0.pcie_tx_bytes_per_second == 1000 * 1024
    assert gpu0.pcie_rx_bytes_per_second == 3000 * 1024
    assert gpu0.nvlink_tx_bytes_per_second > 0 and gpu0.nvlink_rx_bytes_per_second > 0
    assert gpu1.xid_errors == {79: 1} and gpu0.xid_errors == {}

    points = {(name, tuple(sorted(attrs.items()))): value for name, value, attrs in
              metric_points([gpu0, gpu1])}  # fmt: skip
    by_name: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for (name, attrs), value in points.items():
        by_name.setdefault(name, []).append((dict(attrs), value))
    for name in ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.energy"):
        assert {a["hw.id"] for a, _ in by_name[name]} == {"GPU-0000", "GPU-0001"}, name
    assert [a["hw.id"] for a, _ in by_name["hw.power"]] == ["GPU-0000"]  # GPU 1: unsupported
    errors = {(a["hw.id"], a["error.type"]): v for a, v in by_name["hw.errors"]}
    assert errors[("GPU-0001", "xid.79")] == 1 and errors[("GPU-0001", "xid")] == 1
    assert errors[("GPU-0000", "xid")] == 0
    collector.stop()
    assert nvml.calls[-2:] == ["free", "shutdown"]


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (None, "nvidia-ml-py (pynvml) is not installed"),
        (fake_pynvml(init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found")),
         "NVML unavailable (NVML Shared Library Not Found)"),
        (fake_pynvml(gpus=0), "NVML reports no GPUs"),
    ],
)  # fmt: skip
def test_absent_library_driver_or_gpus_are_reported_not_raised(module: Any, expected: str) -> None:
    collector = NvmlCollector(nvml=module, loader=lambda: None)
    assert not collector.available and expected in collector.status
    assert collector.sample() == [] and collector.latest == []
    collector.start()
    collector.stop()


def test_daemon_reports_gpu_collector_and_publishes_hw_metrics() -> None:
    server = DaemonServer(
        "127.0.0.1:0", host_interval=0.2, nvml=NvmlCollector(nvml=fake_pynvml(gpus=1))
    ).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            status = daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest())
        assert status.gpu_collector == "nvml: 1 GPU(s)"
        names = {p.name for p in daemon_points(server.service)}
        assert {"hw.gpu.utilization", "hw.power", "hw.energy", "hw.errors"} <= names
        # A rank on this host using cuda:0 gets GPU 0's utilization in its metrics.
        resource = {
            telemetry_schema.RESOURCE_JOB_ID: "gpu",
            telemetry_schema.RESOURCE_RANK: 0,
            telemetry_schema.RESOURCE_DEVICE: "cuda:0",
            "host.name": server.host.hostname,
        }
        server.store.add_metric_points(resource, {"plait.train.loss": 1.0})
        with grpc.insecure_channel(server.address) as channel:
            metrics = daemon_pb2_grpc.DaemonStub(channel).GetMetrics(daemon_pb2.GetMetricsRequest())
        (rank,) = metrics.ranks
        assert rank.device_utilization == pytest.approx(0.40)
    finally:
        server.stop(grace=0.5)
