"""Benchmark plait's communication algorithms against the backend's own all-reduce, same run.

    python tools/bench/comm.py [--world-size 2] [--sizes 4K,64K,1M,16M] [--algorithms ring,tree]

Spawns the ranks (Gloo on CPU, over a FileStore), then for every message size and algorithm
times fp32 all-reduces with purpose `"grad_bucket"`, so the compression and parameter-server
plugins take them over exactly as they would take over a data-parallel gradient bucket. The
algorithms take turns op by op. The table gives the median latency, the algorithm bandwidth
(message bytes / latency, as in nccl-tests' `algbw`), the bus bandwidth (`2(n-1)/n` times that,
nccl-tests' `busbw`), the bytes each rank really put on the wire per op (counted by the traffic
meter on the communicate hook) and the speed against the backend's all-reduce of the same size.
Compression trades accuracy for bytes; only the latency and byte columns compare like with like.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from plait.core.comm import Comm, world_group
from plait.core.comm_algorithms import GRAD_BUCKET
from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.plugins.collectives.metering import TrafficMeter
from plait.testing.distributed import run_distributed

# name -> the [comm] section that selects it (options in [comm.<algorithm>])
ALGORITHMS: dict[str, dict[str, object]] = {
    "torch": {"algorithm": "torch"},
    "ring": {"algorithm": "ring"},
    "tree": {"algorithm": "tree"},
    "fp16": {"algorithm": "fp16"},
    "bf16": {"algorithm": "bf16"},
    "powersgd": {"algorithm": "powersgd", "powersgd": {"rank": 4}},
    "topk": {"algorithm": "topk", "topk": {"ratio": 0.01}},
    "param_server": {"algorithm": "param_server"},
}
ALGORITHM_PLUGINS = (
    ("collectives", "plait.plugins.collectives"),
    ("compression", "plait.plugins.compression"),
    ("param_server", "plait.plugins.param_server"),
)
BACKEND_AND_ALGORITHMS = (("torch_comm", "plait.plugins.torch_comm"), *ALGORITHM_PLUGINS)
UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human_bytes(count: float) -> str:
    for unit, scale in (("MB", 1024**2), ("KB", 1024)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"


def build_comm(comm_section: dict[str, object]) -> tuple[Comm, TrafficMeter, Plugins]:
    """A `Comm` over the backend and the algorithm plugins, configured as an engine would be
    (options validated from `[comm.<name>]`, the dp group given a dedicated process group)."""
    meter = TrafficMeter()
    plugins = Plugins.create(
        autoload=False, builtins=BACKEND_AND_ALGORITHMS, extra=[("traffic_meter", meter)]
    )
    plugins.configure(load_config({"comm": comm_section}))
    return Comm(plugins), meter, plugins


def repetitions(nbytes: int) -> int:
    return max(6, min(40, (32 * 1024**2) // max(nbytes, 1)))


def bench_rank(
    rank: int, world_size: int, sizes: Sequence[int], algorithms: Sequence[str]
) -> list[tuple[str, int, float, float]]:
    """Every rank runs every case; returns (algorithm, bytes, median seconds, wire bytes/op).

    For each size the algorithms take turns op by op (the order rotating every repetition), so
    a burst of load on a shared machine hits all of them alike."""
    rows = []
    group = world_group()
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        built = {name: build_comm(ALGORITHMS[name]) for name in algorithms}
        generator = torch.Generator().manual_seed(rank)
        data = torch.randn(numel, generator=generator)
        reps = repetitions(nbytes)
        samples: dict[str, list[float]] = {name: [] for name in algorithms}
        for rep in range(reps + 2):
            shift = rep % len(algorithms)
            for name in [*algorithms[shift:], *algorithms[:shift]]:
                comm, meter, _ = built[name]
                bucket = data.clone()
                dist.barrier()
                start = time.perf_counter()
                comm.all_reduce(
                    bucket,
                    group=group,
                    op="avg",
                    async_op=True,
                    purpose=GRAD_BUCKET,
                    attributes={"bucket_index": 0},
                ).wait()
                elapsed = time.perf_counter() - start
                if rep == 1:
                    meter.reset()  # the first two calls warm up (and let PowerSGD pick its Q)
                if rep >= 2:
                    samples[name].append(elapsed)
        for name in algorithms:
            comm, meter, plugins = built[name]
            # An algorithm's traffic is its sub-ops; the backend's is the request itself.
            own = GRAD_BUCKET if name == "torch" else None
            wire = meter.bytes_for(lambda p, own=own: p == own if own else p != GRAD_BUCKET)
            wire /= reps
            plugins.job_end()  # drains the parameter server, stops the algorithm's worker
            rows.append((name, numel * 4, statistics.median(samples[name]), wire))
    return rows


def render(rows: list[tuple[str, int, float, float]], world_size: int) -> str:
    """`busbw` is nccl-tests' bus bandwidth, 2(n-1)/n · size / time: what each rank's link
    carried per second in a bandwidth-optimal all-reduce, comparable across group sizes."""
    backend = {size: seconds for name, size, seconds, _ in rows if name == "torch"}
    bus_factor = 2 * (world_size - 1) / world_size
    header = (
        f"{'algorithm':<13}{'size':>10}{'latency':>12}{'algbw':>12}{'busbw':>12}"
        f"{'wire/rank':>12}{'vs torch':>10}"
    )
    lines = [f"all-reduce, fp32, {world_size} ranks, Gloo on CPU", header, "-" * len(header)]
    for name, size, seconds, wire in rows:
        speed = backend.get(size, float("nan")) / seconds
        lines.append(
            f"{name:<13}{human_bytes(size):>10}{seconds * 1e6:>10.0f}us"
            f"{size / seconds / 1e6:>8.0f} MB/s{bus_factor * size / seconds / 1e6:>8.0f} MB/s"
            f"{human_bytes(wire):>12}{speed:>9.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="4K,64K,1M,16M", help="message sizes, e.g. 4K,1M")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        parser.error(f"unknown algorithms {unknown}; choose from {', '.join(ALGORITHMS)}")
    if "torch" not in algorithms:
        algorithms.insert(0, "torch")  # the peer every other row is compared with
    per_rank = run_distributed(bench_rank, args.world_size, sizes, algorithms, timeout=1800)
    print(render(per_rank[0], args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
