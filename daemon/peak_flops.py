"""Peak FLOP/s of a rank's device: a datasheet table for accelerators, a cached GEMM on CPU.

MFU divides by this figure, so it has to be the same for every rank of one kind of device and
it has to be a real ceiling (an MFU above 100 % means the peak is wrong, see `plait.daemon.mfu`).

Accelerators: `DEVICE_PEAK_TFLOPS` holds dense (no structured sparsity) figures per dtype. A
device is found by its **exact** name as torch / NVML report it, through `DEVICE_NAME_ALIASES`;
a name that is not listed is unknown (MFU 0 and one warning), never the nearest substring
("NVIDIA L40" is not an "NVIDIA L4"). The dtype is the job's compute dtype (the precision
policy's under autocast), TF32 for float32 matmuls when torch allows it.

CPU: no constant stands in for a measurement (machines of one model differ by 4x per core with
turbo, memory and power limits), so the peak is **measured once per host and cached**:

* all the host's cores busy at once (one torch GEMM with the intra-op pool set to every core
  this process may run on), square 1024 matrices, warm-up then the best of five 0.4 s trials;
* in the dtype the CPU computes fastest: float32, bfloat16 and float16 are probed briefly
  (512² GEMMs, best of two) and the fastest is measured (an AVX2 CPU has no fast bf16 GEMM,
  so a bf16 peak there would be a tenth of what its float32 units deliver and put MFU above
  100 %);
* cached in `$PLAIT_CACHE_DIR` (default `$XDG_CACHE_HOME/plait`, else `~/.cache/plait`) in
  `cpu-peak-<cpu model>-<cores>c.json`. The first process of a host that needs it measures
  under an exclusive file lock while the others wait on the lock, then read the same file;
  `plait calibrate` (or `plait daemon` at start) measures before any rank runs;
* each rank gets the host figure divided by the ranks of its host (`$LOCAL_WORLD_SIZE`), so
  every rank of a host reports the same peak and the job's peak is the hosts' sum;
* a measurement that had to share the cores (its GEMM threads got less than
  `SETTLED_CPU_SHARE` of the cores' time: other processes were running) is kept but not
  *settled*: it is taken again once it is `UNSETTLED_RETRY_SECONDS` old, and the cache keeps the
  higher of two figures (load can slow a GEMM down, never speed it up past the hardware). So a
  first measurement on a busy host does not stay the host's ceiling for ever (ranks on a quiet
  host would then read MFU above 100 %), and a busy host is not measured again at every start.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from plait.core.atomic_files import write_json_atomically
from plait.core.host import cache_dir, cpu_model, host_cores

# Dense peak TFLOP/s per device and dtype, from the vendors' datasheets (sparsity figures
# halved):
#   H100 SXM / PCIe / NVL, H200, GH200: NVIDIA H100, H200 and GH200 datasheets (2023-2024)
#   A100: NVIDIA A100 Tensor Core GPU datasheet (2021); A10, L4, L40, L40S: product datasheets
#   V100: NVIDIA Tesla V100 datasheet (2020); B200: NVIDIA HGX B200 datasheet, per GPU (÷ 8)
#   MI300X: AMD Instinct MI300X data sheet (2023)
DEVICE_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "H100 PCIe": {"bfloat16": 756.5, "float16": 756.5, "tf32": 378.0, "float32": 51.2},
    "H100 NVL": {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0},
    "H200 SXM": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "H200 NVL": {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0},
    "B200": {"bfloat16": 2250.0, "float16": 2250.0, "tf32": 1100.0, "float32": 75.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.05, "float16": 362.05, "tf32": 183.0, "float32": 91.6},
    "L40": {"bfloat16": 181.05, "float16": 181.05, "tf32": 90.5, "float32": 90.5},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "tf32": 60.0, "float32": 30.3},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "tf32": 62.5, "float32": 31.2},
    "V100": {"float16": 125.0, "float32": 15.7},
    "MI300X": {"bfloat16": 1307.4, "float16": 1307.4, "tf32": 653.7, "float32": 163.4},
}

# Exact device names (`torch.cuda.get_device_name`, `nvidia-smi`) -> table entry. Compared after
# `normalise_device_name`; nothing is matched by substring.
DEVICE_NAME_ALIASES: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 SXM5 80GB": "H100 SXM",
    "NVIDIA H100 SXM5 64GB": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA GH200 480GB": "H100 SXM",
    "NVIDIA H200": "H200 SXM",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA B200": "B200",
    "NVIDIA A100-SXM4-40GB": "A100",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100-PCIE-40GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100",
    "NVIDIA L40S": "L40S",
    "NVIDIA L40": "L40",
    "NVIDIA L4": "L4",
    "NVIDIA A10": "A10",
    "Tesla V100-SXM2-16GB": "V100",
    "Tesla V100-SXM2-32GB": "V100",
    "Tesla V100-PCIE-16GB": "V100",
    "Tesla V100-PCIE-32GB": "V100",
    "AMD Instinct MI300X": "MI300X",
}

CPU_SOURCE = "cpu-calibration"
CALIBRATION_DTYPES = ("float32", "bfloat16", "float16")
GEMM_SIZE = 1024
PROBE_SIZE = 512
PROBE_SECONDS = 0.1
WARMUP_SECONDS = 0.3
TRIAL_SECONDS = 0.4
TRIALS = 5
# The best trial's GEMM threads got at least this share of the cores' time: it had them alone.
SETTLED_CPU_SHARE = 0.9
UNSETTLED_RETRY_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class PeakFlops:
    """A device's peak FLOP/s for one dtype and where the figure comes from."""

    flops: float
    source: str


def normalise_device_name(name: str) -> str:
    return " ".join(name.split()).casefold()


_ALIASES = {normalise_device_name(k): v for k, v in DEVICE_NAME_ALIASES.items()}
_ALIASES.update({normalise_device_name(k): k for k in DEVICE_PEAK_TFLOPS})


# The spellings a dtype arrives in (config fields, torch's names) → the table's column.
_DTYPE_NAMES = {
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "fp32": "float32", "float": "float32", "torch.float32": "float32",
}  # fmt: skip


def normalise_dtype_name(dtype: str) -> str:
    """`bf16`, `torch.bfloat16` and `bfloat16` name one column of the peak table."""
    return _DTYPE_NAMES.get(dtype.casefold(), dtype.casefold())


def lookup_device_peak_flops(device_name: str, dtype: str) -> PeakFlops | None:
    """The table's dense peak for exactly `device_name` and `dtype`; `None` if not listed."""
    dtype = normalise_dtype_name(dtype)
    entry = _ALIASES.get(normalise_device_name(device_name))
    if entry is None:
        return None
    tflops = DEVICE_PEAK_TFLOPS[entry].get(dtype)
    if tflops is None:
        return None
    return PeakFlops(flops=tflops * 1e12, source=f"table: {entry} {dtype} dense")


def accelerator_peak_flops(device_name: str, dtype: str, *, allow_tf32: bool) -> PeakFlops:
    """The table's peak for a GPU rank computing in `dtype` (0 and a warning when unknown)."""
    dtype = normalise_dtype_name(dtype)
    if dtype == "float32" and allow_tf32:
        dtype = "tf32"  # float32 matmuls run on tensor cores as TF32 when torch allows it
    found = lookup_device_peak_flops(device_name, dtype)
    if found is not None:
        return found
    warnings.warn(
        f"no peak FLOP/s known for {device_name!r} in {dtype}; MFU is reported as 0 for this "
        "rank (add its exact name to plait.daemon.peak_flops.DEVICE_NAME_ALIASES)",
        stacklevel=2,
    )
    return PeakFlops(flops=0.0, source="unknown")


# --------------------------------------------------------------------------------------------
# CPU: measured once per host
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CpuCalibration:
    """The measured GEMM rate of a whole host, as cached on disk."""

    flops: float  # FLOP/s of all cores together, in `dtype`
    dtype: str
    probe_flops: dict[str, float]  # the short probe's rate per dtype
    cpu_model: str
    cores: int
    gemm_size: int
    seconds: float  # how long the measurement took
    measured_at: float  # Unix time
    measured_by: str  # host:pid
    # CPU time the best trial's threads got over (wall time × cores); None: not recorded (a file
    # written before it was), which counts as unsettled.
    cpu_share: float | None = None

    @property
    def settled(self) -> bool:
        """Measured with the cores to itself."""
        return self.cpu_share is not None and self.cpu_share >= SETTLED_CPU_SHARE

    def due_again(self, now: float | None = None) -> bool:
        """An unsettled figure, old enough to be measured again."""
        age = (time.time() if now is None else now) - self.measured_at
        return not self.settled and age >= UNSETTLED_RETRY_SECONDS

    def per_rank(self, ranks_on_host: int) -> PeakFlops:
        ranks = max(ranks_on_host, 1)
        day = time.strftime("%Y-%m-%d", time.localtime(self.measured_at))
        return PeakFlops(
            flops=self.flops / ranks,
            source=f"{CPU_SOURCE}: {self.dtype} GEMM on {self.cores} cores / {ranks} ranks, "
            f"measured {day}",
        )


def calibration_path(model: str | None = None, cores: int | None = None) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", (model or cpu_model()).casefold()).strip("-") or "cpu"
    return cache_dir() / f"cpu-peak-{slug}-{cores or host_cores()}c.json"


def _gemm_rate(torch_dtype: object, size: int, seconds: float) -> float:
    return _gemm_trial(torch_dtype, size, seconds)[0]


def _gemm_trial(torch_dtype: object, size: int, seconds: float) -> tuple[float, float]:
    """(FLOP/s, the share of the cores' time this process's threads got) over `seconds`."""
    import torch

    a = torch.randn(size, size).to(torch_dtype)  # type: ignore[arg-type]
    b = torch.randn(size, size).to(torch_dtype)  # type: ignore[arg-type]
    torch.mm(a, b)
    count, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            # Process time counts every thread of the process (a daemon's or a test's own
            # threads too), so it can pass the GEMM threads' wall time; a share is at most 1.
            busy = (time.process_time() - cpu_start) / (elapsed * torch.get_num_threads())
            return count * 2.0 * size**3 / elapsed, min(busy, 1.0)


def measure_cpu_peak(
    *,
    size: int = GEMM_SIZE,
    trial_seconds: float = TRIAL_SECONDS,
    trials: int = TRIALS,
    warmup_seconds: float = WARMUP_SECONDS,
    probe_seconds: float = PROBE_SECONDS,
    dtypes: tuple[str, ...] = CALIBRATION_DTYPES,
) -> CpuCalibration:
    """Measure this host's GEMM peak now (every core at once, the fastest dtype)."""
    import torch

    started = time.perf_counter()
    cores = host_cores()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        # Wake the thread pool first, and probe each dtype twice (best of), so a busy moment
        # cannot make a slow dtype look fastest.
        _gemm_rate(torch.float32, PROBE_SIZE, probe_seconds)
        probes: dict[str, float] = {}
        for _ in range(2):
            for name in dtypes:
                try:
                    rate = _gemm_rate(getattr(torch, name), PROBE_SIZE, probe_seconds)
                except (RuntimeError, AttributeError):  # no CPU GEMM for this dtype here
                    continue
                probes[name] = max(rate, probes.get(name, 0.0))
        dtype = max(probes, key=probes.__getitem__) if probes else "float32"
        torch_dtype = getattr(torch, dtype)
        _gemm_rate(torch_dtype, size, warmup_seconds)
        best, share = max(_gemm_trial(torch_dtype, size, trial_seconds) for _ in range(trials))
    finally:
        torch.set_num_threads(previous_threads)
    return CpuCalibration(
        flops=best,
        dtype=dtype,
        probe_flops=probes,
        cpu_model=cpu_model(),
        cores=cores,
        gemm_size=size,
        seconds=time.perf_counter() - started,
        measured_at=time.time(),
        measured_by=f"{socket.gethostname()}:{os.getpid()}",
        cpu_share=round(share, 3),
    )


def read_calibration(path: Path) -> CpuCalibration | None:
    try:
        data = json.loads(path.read_text())
        calibration = CpuCalibration(**data)
    except (OSError, ValueError, TypeError):
        return None  # absent, half-written by an older version or corrupt: measure again
    return calibration if calibration.flops > 0 else None


def host_cpu_calibration(
    *, force: bool = False, measure_kwargs: Mapping[str, object] | None = None
) -> tuple[CpuCalibration, Path]:
    """This host's cached calibration, measured now if there is none, if it is unsettled and
    due again (`CpuCalibration.due_again`), or if `force`. A measurement taken because the cached
    one was due replaces it only when it is higher; a forced one (`plait calibrate --force`, on
    an idle host) replaces it whatever it is.

    The measurement runs under an exclusive lock on `<file>.lock`: concurrent callers on the
    host (the ranks of a job) block until it is written, then read it, so the GEMM has the
    cores to itself and every rank reads the same figure.
    """
    path = calibration_path()
    if not force:
        cached = read_calibration(path)
        if cached is not None and not cached.due_again():
            return cached, path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cached = read_calibration(path)
            if cached is not None and not force and not cached.due_again():
                return cached, path  # another process measured while we waited
            calibration = measure_cpu_peak(**dict(measure_kwargs or {}))  # type: ignore[arg-type]
            if not force and cached is not None and cached.flops > calibration.flops:
                # Slower now: this measurement shared the cores. Keep the higher figure; it
                # counts as settled once a measurement had the cores alone.
                settled = calibration.settled or cached.settled
                calibration = replace(
                    cached,
                    measured_at=calibration.measured_at,
                    cpu_share=max(calibration.cpu_share or 0.0, cached.cpu_share or 0.0)
                    if settled
                    else calibration.cpu_share,
                )
            write_json_atomically(path, asdict(calibration), indent=2)
            return calibration, path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ranks_on_this_host() -> int:
    """Ranks of this job on this host, from torchrun's `$LOCAL_WORLD_SIZE` (1 when absent)."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def peak_flops_for(device: str, device_name: str, dtype: str) -> PeakFlops:
    """Peak FLOP/s of one rank computing in `dtype` (the job's compute dtype) on `device`."""
    if device.startswith("cpu"):
        calibration, _ = host_cpu_calibration()
        return calibration.per_rank(ranks_on_this_host())
    import torch

    return accelerator_peak_flops(
        device_name, dtype, allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32)
    )
