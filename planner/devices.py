"""Devices the planner prices: peak rate, memory, memory bandwidth, links, GEMM efficiency.

Peaks come from `plait.daemon.peak_flops` (the table MFU uses). The rest are datasheet figures,
with the efficiency curve and link speeds replaced by measurements where plait has them:
`plait plan calibrate` fits the links from the daemon's comm spans, and on CPU the bench
measures GEMM rates at several sizes (`efficiency_from_gemm_rates`).

Efficiency by op size: a GEMM of `g` FLOPs runs at `peak · e_max · g / (g + g_half)` — large
GEMMs reach `e_max` (what cuBLAS delivers on big bf16 matmuls: ~80 % of an A100's peak, ~72 %
of an H100 SXM's), small ones are latency bound. Attention kernels reach `attention_efficiency`
of peak (FlashAttention-2 forward+backward: ~55 % on A100, ~40 % on H100).

The host beside each device, for ZeRO's offload (`[zero.offload]`): its PCIe link (`host_link`,
α–β like the other links), its share of the node's RAM (`host_memory_bytes`) and of the CPUs'
memory bandwidth (`host_memory_bandwidth`, what the optimizer step runs at on the CPU), and of
the node's local drives (`disk_bandwidth`). `host_memory_bytes = None` says there is no host
apart from the device: a CPU is both, and offload to it moves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from plait.core.errors import ConfigError
from plait.daemon.peak_flops import DEVICE_PEAK_TFLOPS

GIB = 2**30
# Of the host memory per device, what offloaded state may take: the OS, data-loader workers and
# the page cache share the host.
USABLE_HOST_MEMORY_FRACTION = 0.8


@dataclass(frozen=True, slots=True, kw_only=True)
class OpLink:
    """α–β of one collective on a link, where it was fitted on its own."""

    op: str  # a collective family: "all_reduce", "all_gather", ..., "send" for point-to-point
    alpha: float
    beta: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """α–β model of one kind of link: a message of `n` bytes takes `alpha + n / beta` seconds."""

    alpha: float  # seconds per message (latency)
    beta: float  # bytes per second (per rank's share of the link)
    # Collectives fitted on their own. A backend implements each collective with its own
    # algorithm and copies (Gloo's reduce-scatter costs several of its all-reduces; NCCL's
    # all-gather and all-reduce reach different bus bandwidths), so one α–β for all of them
    # prices some far off; the shared pair above serves the collectives without one.
    by_op: tuple[OpLink, ...] = ()

    def for_op(self, op: str) -> tuple[float, float]:
        """(α, β) of collective family `op` on this link."""
        for entry in self.by_op:
            if entry.op == op:
                return entry.alpha, entry.beta
        return self.alpha, self.beta


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float  # dense, in the compute dtype
    memory_bandwidth: float  # bytes/s, for element-wise and optimizer work
    gemm_efficiency: float  # e_max
    gemm_half_flops: float  # g_half
    attention_efficiency: float
    intra_node: Link
    inter_node: Link
    usable_memory_fraction: float = 0.92  # allocator fragmentation, CUDA context, NCCL buffers
    # Ranks per core when several ranks share a CPU host's cores (1: a dedicated device). The
    # rates above are then those measured with every rank busy; a rank idling in a pipeline
    # bubble hands its share of the cores to the others, so idle time costs less.
    oversubscription: float = 1.0
    # Fixed seconds per transformer block and forward pass (backward: twice) for launching its
    # ~25 kernels whatever their size (~4 µs each on a GPU); on CPU, Python dispatch.
    block_overhead: float = 1e-4
    # Fixed host seconds that a strategy adds beyond its modelled collectives, whatever the
    # sizes: per block pass and tp peer under tensor parallelism (sharded-tensor dispatch of
    # every op, the collectives' launches, and each ring step of the pass's blocking
    # collectives waiting for a peer that shares the cores), per ZeRO-3 unit and micro-batch
    # (the gather / release hooks, flattening gradients into the unit's bucket), per block
    # and micro-batch under selective recomputation (its policy decides op by op, in the
    # forward and again in the replay), and per micro-batch (the engine's loss, scaling and
    # hooks around each forward + backward).
    # Next to a GPU's kernels they run ahead of the device and hide (0); on a CPU host they are
    # measured (`tools/bench/plan.py`).
    # plait's ZeRO reduces gradient buckets with an all-reduce where the backend has no fast
    # reduce-scatter (Gloo, CPU tensors: `plait.plugins.zero.reduction`); NCCL reduce-scatters.
    grads_reduce_by_all_reduce: bool = False
    tp_block_overhead: float = 0.0
    zero3_unit_overhead: float = 0.0
    selective_block_overhead: float = 0.0
    microbatch_overhead: float = 0.0
    # The host, per device (see the module docstring). Defaults: PCIe Gen4 x16 at what copies
    # from pinned memory reach (~22 GB/s each way), a DGX A100's 1 TiB of RAM and ~400 GB/s
    # of DDR4 bandwidth over 8 GPUs, and its NVMe drives' ~25 GB/s over 8.
    host_link: Link = Link(alpha=10e-6, beta=22e9)
    host_memory_bytes: float | None = 128 * GIB
    host_memory_bandwidth: float = 50e9
    disk_bandwidth: float = 3e9

    def gemm_seconds(self, flops: float, gemm_flops: float) -> float:
        """Time of `flops` of matmul work done in GEMMs of `gemm_flops` each."""
        efficiency = self.gemm_efficiency * gemm_flops / (gemm_flops + self.gemm_half_flops)
        return flops / (self.peak_flops * efficiency)

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def usable_host_memory(self) -> float | None:
        """Host memory per device that offloaded state may take (`None`: no separate host)."""
        if self.host_memory_bytes is None:
            return None
        return self.host_memory_bytes * USABLE_HOST_MEMORY_FRACTION


def _tflops(entry: str, dtype: str = "bfloat16") -> float:
    return DEVICE_PEAK_TFLOPS[entry][dtype] * 1e12


# Links: NVLink bus bandwidth per GPU as all-reduce benchmarks reach it (A100 NVLink3 ~230 GB/s
# of 300, H100 NVLink4 ~360 GB/s of 450); inter-node one NIC per GPU (HDR 200 Gb/s on DGX A100,
# NDR 400 Gb/s on DGX H100) at ~90 % of line rate.
DEVICES: dict[str, DeviceSpec] = {
    "A100-80GB": DeviceSpec(
        name="A100-80GB",
        memory_bytes=80 * GIB,
        peak_flops=_tflops("A100"),
        memory_bandwidth=2.0e12,
        gemm_efficiency=0.80,
        gemm_half_flops=2e9,
        attention_efficiency=0.55,
        intra_node=Link(alpha=8e-6, beta=230e9),
        inter_node=Link(alpha=15e-6, beta=22.5e9),
    ),
    "A100-40GB": DeviceSpec(
        name="A100-40GB",
        memory_bytes=40 * GIB,
        peak_flops=_tflops("A100"),
        memory_bandwidth=1.55e12,
        gemm_efficiency=0.80,
        gemm_half_flops=2e9,
        attention_efficiency=0.55,
        intra_node=Link(alpha=8e-6, beta=230e9),
        inter_node=Link(alpha=15e-6, beta=22.5e9),
    ),
    "H100-80GB": DeviceSpec(
        name="H100-80GB",
        memory_bytes=80 * GIB,
        peak_flops=_tflops("H100 SXM"),
        memory_bandwidth=3.35e12,
        gemm_efficiency=0.72,
        gemm_half_flops=6e9,
        attention_efficiency=0.40,
        intra_node=Link(alpha=8e-6, beta=360e9),
        inter_node=Link(alpha=15e-6, beta=45e9),
        # DGX H100/H200: PCIe Gen5 (~45 GB/s each way), 2 TiB of DDR5 (~600 GB/s) over 8 GPUs
        host_link=Link(alpha=10e-6, beta=45e9),
        host_memory_bytes=256 * GIB,
        host_memory_bandwidth=75e9,
    ),
    "H200-141GB": DeviceSpec(
        name="H200-141GB",
        memory_bytes=141 * GIB,
        peak_flops=_tflops("H200 SXM"),
        memory_bandwidth=4.8e12,
        gemm_efficiency=0.74,
        gemm_half_flops=6e9,
        attention_efficiency=0.42,
        intra_node=Link(alpha=8e-6, beta=360e9),
        inter_node=Link(alpha=15e-6, beta=45e9),
        # DGX H100/H200: PCIe Gen5 (~45 GB/s each way), 2 TiB of DDR5 (~600 GB/s) over 8 GPUs
        host_link=Link(alpha=10e-6, beta=45e9),
        host_memory_bytes=256 * GIB,
        host_memory_bandwidth=75e9,
    ),
}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ConfigError(f"--device: unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[name]


def with_links(device: DeviceSpec, *, intra: Link | None, inter: Link | None) -> DeviceSpec:
    """`device` with measured links in place of the datasheet's."""
    return replace(
        device, intra_node=intra or device.intra_node, inter_node=inter or device.inter_node
    )


def efficiency_from_gemm_rates(
    rates: Sequence[tuple[float, float]], peak_flops: float
) -> tuple[float, float]:
    """Fit `(e_max, g_half)` of `rate(g) = peak · e_max · g / (g + g_half)` to measured
    `(gemm_flops, flops_per_second)` pairs: `1/rate` is linear in `1/g`, so it is a least-squares
    line through `(1/g, peak/rate)` with slope `g_half/e_max` and intercept `1/e_max`."""
    if len(rates) < 2:
        raise ValueError("need GEMM rates at two sizes at least")
    xs = [1.0 / g for g, _ in rates]
    ys = [peak_flops / r for _, r in rates]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    slope = max(slope, 0.0)
    intercept = max(mean_y - slope * mean_x, 1e-6)
    e_max = 1.0 / intercept
    return e_max, slope * e_max
