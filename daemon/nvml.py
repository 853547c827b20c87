"""NVML collector: the node's NVIDIA GPUs through nvidia-ml-py, under OpenTelemetry names.

Sampled on a background thread every `interval` seconds (queries read the last sample). Per GPU:
utilization, memory, power, energy, SM clock, clock-throttle reasons, PCIe and NVLink
throughput, and XID (critical error) events, published as the OpenTelemetry hardware semantic
conventions where they exist (`hw.gpu.utilization`, `hw.gpu.memory.usage`,
`hw.gpu.memory.limit`, `hw.power`, `hw.energy`, `hw.errors`, each with `hw.id`) and as
`plait.gpu.*` where they do not (SM clock, throttle reasons, link throughput).

The `pynvml` module may be injected (tests pass a fake with nvidia-ml-py's function names).
No library, no driver or no GPU is a normal state, reported by `status`, never an error; a
metric a GPU does not support (NVML_ERROR_NOT_SUPPORTED) is left out for that GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

# Throttle-reason bits, by nvidia-ml-py's constant names (same values in the Event names).
THROTTLE_REASONS = (
    ("gpu_idle", "nvmlClocksThrottleReasonGpuIdle"),
    ("applications_clocks", "nvmlClocksThrottleReasonApplicationsClocksSetting"),
    ("sw_power_cap", "nvmlClocksThrottleReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksThrottleReasonHwSlowdown"),
    ("sync_boost", "nvmlClocksThrottleReasonSyncBoost"),
    ("sw_thermal", "nvmlClocksThrottleReasonSwThermalSlowdown"),
    ("hw_thermal", "nvmlClocksThrottleReasonHwThermalSlowdown"),
    ("hw_power_brake", "nvmlClocksThrottleReasonHwPowerBrakeSlowdown"),
)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one moment; `None` means NVML does not support the figure on this GPU."""

    index: int
    uuid: str
    name: str
    utilization: float | None = None  # 0..1, SM busy
    memory_utilization: float | None = None  # 0..1, memory controller busy
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    energy_joules: float | None = None  # since the driver loaded
    sm_clock_hz: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    xid_errors: dict[int, int] = field(default_factory=dict)  # XID code -> count since start


MetricPoint = tuple[str, float, dict[str, Any]]  # (name, value, attributes)


def metric_points(samples: list[GpuSample]) -> list[MetricPoint]:
    """The samples as OpenTelemetry-named points (semantic conventions where they exist)."""
    points: list[MetricPoint] = []
    for gpu in samples:
        base = {"hw.id": gpu.uuid or str(gpu.index), "hw.name": gpu.name, "hw.type": "gpu"}

        def add(name: str, value: float | None, base: dict[str, Any] = base, **extra: Any) -> None:
            if value is not None:
                points.append((name, float(value), {**base, **extra}))

        add("hw.gpu.utilization", gpu.utilization, **{"hw.gpu.task": "general"})
        add("hw.gpu.memory.utilization", gpu.memory_utilization)
        add("hw.gpu.memory.usage", gpu.memory_used_bytes)
        add("hw.gpu.memory.limit", gpu.memory_total_bytes)
        add("hw.power", gpu.power_watts)
        add("hw.energy", gpu.energy_joules)
        add("plait.gpu.sm_clock", gpu.sm_clock_hz)
        add("plait.gpu.throttled", 1.0 if set(gpu.throttle_reasons) - {"gpu_idle"} else 0.0)
        for reason in gpu.throttle_reasons:
            add("plait.gpu.throttle_reason", 1.0, **{"plait.gpu.throttle_reason": reason})
        for direction, value in (
            ("transmit", gpu.pcie_tx_bytes_per_second),
            ("receive", gpu.pcie_rx_bytes_per_second),
        ):
            add("plait.gpu.pcie.throughput", value, **{"network.io.direction": direction})
        for direction, value in (
            ("transmit", gpu.nvlink_tx_bytes_per_second),
            ("receive", gpu.nvlink_rx_bytes_per_second),
        ):
            add("plait.gpu.nvlink.throughput", value, **{"network.io.direction": direction})
        total_xid = sum(gpu.xid_errors.values())
        add("hw.errors", total_xid, **{"error.type": "xid"})
        for code, count in sorted(gpu.xid_errors.items()):
            add("hw.errors", count, **{"error.type": f"xid.{code}"})
    return points


def _load_pynvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class NvmlCollector:
    """Samples every GPU NVML sees; `status` says how many, or why there are none."""

    def __init__(
        self,
        *,
        interval: float = 1.0,
        nvml: ModuleType | None = None,
        loader: Callable[[], ModuleType | None] = _load_pynvml,
    ) -> None:
        self.interval = interval
        self.nvml = nvml if nvml is not None else loader()
        self.available = False
        self.status = ""
        self.latest: list[GpuSample] = []
        self._handles: list[Any] = []
        self._events: Any = None
        self._xid: list[dict[int, int]] = []
        self._uuids: list[Any] = []
        self._nvlink_previous: list[tuple[float, float, float] | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._init()

    def _init(self) -> None:
        nvml = self.nvml
        if nvml is None:
            self.status = "no GPU metrics: nvidia-ml-py (pynvml) is not installed"
            return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self.status = f"no GPU metrics: NVML unavailable ({exc})"
            return
        try:
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nvml.NVMLError as exc:
            self.status = f"no GPU metrics: {exc}"
            nvml.nvmlShutdown()
            return
        if not self._handles:
            self.status = "no GPU metrics: NVML reports no GPUs"
            nvml.nvmlShutdown()
            return
        self._xid = [{} for _ in self._handles]
        self._uuids = [self._optional(lambda h=h: nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._nvlink_previous = [None for _ in self._handles]
        self._register_xid_events()
        self.available = True
        self.status = f"nvml: {len(self._handles)} GPU(s)"
        self.latest = self.sample()

    def _register_xid_events(self) -> None:
        nvml = self.nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._events
                )
        except nvml.NVMLError as exc:  # not supported on every GPU / in containers
            logger.info("XID events unavailable: %s", exc)
            self._events = None

    def _optional(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except self.nvml.NVMLError:  # type: ignore[union-attr]
            return None

    def _drain_xid_events(self) -> None:
        nvml = self.nvml
        if self._events is None:
            return
        for _ in range(1000):  # bounded: never spin on a misbehaving driver
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: no more events
                return
            # ctypes handles do not compare by value: match the event's GPU by its UUID.
            uuid = self._optional(lambda e=event: nvml.nvmlDeviceGetUUID(e.device))
            index = self._uuids.index(uuid) if uuid in self._uuids else -1
            if index >= 0:
                code = int(event.eventData)
                self._xid[index][code] = self._xid[index].get(code, 0) + 1
                logger.warning("GPU %d reported XID %d", index, code)

    def _nvlink_rates(self, index: int, handle: Any) -> tuple[float | None, float | None]:
        nvml = self.nvml
        values = self._optional(
            lambda: nvml.nvmlDeviceGetFieldValues(
                handle,
                [
                    nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                    nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                ],
            )
        )
        if not values or any(v.nvmlReturn != 0 for v in values):
            return None, None
        # Counters in KiB since boot: rates come from the previous sample.
        now = time.monotonic()
        tx, rx = (float(v.value.ullVal) * 1024 for v in values)
        previous, self._nvlink_previous[index] = self._nvlink_previous[index], (now, tx, rx)
        if previous is None or now <= previous[0]:
            return 0.0, 0.0
        elapsed = now - previous[0]
        return (tx - previous[1]) / elapsed, (rx - previous[2]) / elapsed

    def sample(self) -> list[GpuSample]:
        if not self.available and not self._handles:
            return []
        nvml = self.nvml
        assert nvml is not None
        self._drain_xid_events()
        samples = []
        for index, handle in enumerate(self._handles):
            opt = self._optional
            rates = opt(lambda h=handle: nvml.nvmlDeviceGetUtilizationRates(h))
            memory = opt(lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h))
            power_mw = opt(lambda h=handle: nvml.nvmlDeviceGetPowerUsage(h))
            energy_mj = opt(lambda h=handle: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
            sm_mhz = opt(lambda h=handle: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
            reasons = opt(lambda h=handle: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
            tx_kbs = opt(
                lambda h=handle: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)
            )
            rx_kbs = opt(
                lambda h=handle: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)
            )
            nvlink_tx, nvlink_rx = self._nvlink_rates(index, handle)
            name = opt(lambda h=handle: nvml.nvmlDeviceGetName(h)) or f"GPU {index}"
            uuid = opt(lambda h=handle: nvml.nvmlDeviceGetUUID(h)) or ""
            samples.append(
                GpuSample(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    utilization=rates.gpu / 100.0 if rates is not None else None,
                    memory_utilization=rates.memory / 100.0 if rates is not None else None,
                    memory_used_bytes=int(memory.used) if memory is not None else None,
                    memory_total_bytes=int(memory.total) if memory is not None else None,
                    power_watts=power_mw / 1000.0 if power_mw is not None else None,
                    energy_joules=energy_mj / 1000.0 if energy_mj is not None else None,
                    sm_clock_hz=sm_mhz * 1e6 if sm_mhz is not None else None,
                    throttle_reasons=tuple(
                        label
                        for label, constant in THROTTLE_REASONS
                        if reasons is not None and reasons & int(getattr(nvml, constant, 0))
                    ),
                    # NVML reports PCIe throughput in KB/s over a 20 ms window.
                    pcie_tx_bytes_per_second=tx_kbs * 1024.0 if tx_kbs is not None else None,
                    pcie_rx_bytes_per_second=rx_kbs * 1024.0 if rx_kbs is not None else None,
                    nvlink_tx_bytes_per_second=nvlink_tx,
                    nvlink_rx_bytes_per_second=nvlink_rx,
                    xid_errors=dict(self._xid[index]),
                )
            )
        return samples

    def utilization_by_index(self) -> dict[int, float]:
        return {g.index: g.utilization for g in self.latest if g.utilization is not None}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.latest = self.sample()
            except Exception:  # a driver hiccup must not end sampling
                logger.exception("NVML sampling failed")

    def start(self) -> None:
        if not self.available:
            return
        self._thread = threading.Thread(target=self._run, name="plait-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.available and self.nvml is not None:
            if self._events is not None:
                self._optional(lambda: self.nvml.nvmlEventSetFree(self._events))  # type: ignore[union-attr]
            self._optional(self.nvml.nvmlShutdown)
            self.available = False
