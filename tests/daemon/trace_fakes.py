"""Kineto traces built by hand in the format `torch.profiler` exports, for the analysis tests.

A CUDA trace cannot be recorded on a machine without a GPU, so `cuda_trace` writes one as
PyTorch 2.x exports it with CUPTI on: host operators and runtime calls on the process's pid,
kernels and memory copies on the device's pid (0) with one thread per stream, the runtime call
and its kernel tied by `args.correlation`, `ac2g` flow events between them, and
`gpu_user_annotation` ranges that mirror host annotations on the device (which the analysis
must not count as kernels). Times are µs from `baseTimeNanoseconds`.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

from plait.daemon.decoder import RankIdentity, SpanRecord
from plait.daemon.deliveries import RankTrace, read_trace

HOST_PID = 4242
GPU_PID = 0
COMPUTE_STREAM = 7
NCCL_STREAM = 20
STEP_US = 1000.0
BASE_NS = 1_700_000_000_000_000_000


def _x(name: str, cat: str, pid: Any, tid: Any, ts: float, dur: float, **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def _metadata(pid: Any, tid: Any, name: str, kind: str = "thread_name") -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}}


# One step of the CUDA trace, relative to the step's start (µs): what each class should get.
CUDA_STEP = {
    "compute_us": 301.0,  # gemm [100, 400] and a 1 µs elementwise kernel [820, 821]
    "communication_us": 300.0,  # NCCL [300, 700], minus the 100 µs under the gemm
    "memory_us": 50.0,  # memcpy [750, 800]
    "communication_total_us": 400.0,
    "overlap_us": 100.0,
    "launches": 4,
    "launch_cpu_us": 30.0,
    "launch_delays_us": (80.0, 260.0, 700.0, 760.0),
    "short_kernels": 1,
}


def cuda_trace(
    steps: tuple[int, ...] = (5, 6), nccl_name: str = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
) -> dict:
    events: list[dict] = [
        _metadata(HOST_PID, 0, "python", "process_name"),
        _metadata(HOST_PID, HOST_PID, "thread 4242 (python)"),
        {"ph": "M", "name": "process_labels", "pid": GPU_PID, "tid": 0, "ts": 0,
         "args": {"labels": "GPU 0"}},
        _metadata(GPU_PID, COMPUTE_STREAM, "stream 7"),
        _metadata(GPU_PID, NCCL_STREAM, "stream 20 "),
    ]  # fmt: skip
    correlation = 100
    for i, step in enumerate(steps):
        t = i * STEP_US
        events.append(_x(f"ProfilerStep#{step}", "user_annotation", HOST_PID, HOST_PID, t, STEP_US))
        events.append(_x(f"ProfilerStep#{step}", "gpu_user_annotation", GPU_PID, COMPUTE_STREAM,
                         t + 100, 700))  # fmt: skip
        events.append(_x("aten::mm", "cpu_op", HOST_PID, HOST_PID, t + 10, 60))
        launches = [
            ("cudaLaunchKernel", 20, 10, "ampere_sgemm_128x64_tn", "kernel", COMPUTE_STREAM,
             100, 300),
            ("cudaLaunchKernel", 40, 5, nccl_name, "kernel", NCCL_STREAM, 300, 400),
            ("cudaMemcpyAsync", 50, 5, "Memcpy HtoD (Pageable -> Device)", "gpu_memcpy",
             COMPUTE_STREAM, 750, 50),
            ("cudaLaunchKernel", 60, 10, "void at::native::vectorized_elementwise_kernel<4>",
             "kernel", COMPUTE_STREAM, 820, 1),
        ]  # fmt: skip
        for runtime, at, took, kernel, cat, stream, start, dur in launches:
            correlation += 1
            events.append(_x(runtime, "cuda_runtime", HOST_PID, HOST_PID, t + at, took,
                             correlation=correlation, cbid=211))  # fmt: skip
            events.append(_x(kernel, cat, GPU_PID, stream, t + start, dur, correlation=correlation,
                             device=0, stream=stream, context=1))  # fmt: skip
            events.append({"ph": "s", "id": correlation, "pid": HOST_PID, "tid": HOST_PID,
                           "ts": t + at, "cat": "ac2g", "name": "ac2g"})  # fmt: skip
            events.append({"ph": "f", "id": correlation, "pid": GPU_PID, "tid": stream,
                           "ts": t + start, "cat": "ac2g", "name": "ac2g", "bp": "e"})  # fmt: skip
        # Not a launch: the analysis counts only calls that start work on the device.
        events.append(_x("cudaStreamSynchronize", "cuda_runtime", HOST_PID, HOST_PID, t + 900, 50))
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
        "baseTimeNanoseconds": BASE_NS,
        "traceEvents": events,
    }


def as_rank_trace(document: dict) -> RankTrace:
    """The trace as the daemon reads a rank's delivery (through the door)."""
    return read_trace(gzip.compress(json.dumps(document).encode()))


def identity(rank: int, job_id: str = "job", host: str = "node-a") -> RankIdentity:
    return RankIdentity(
        job_id=job_id, rank=rank, local_rank=rank, world_size=2, host=host, pid=100 + rank,
        device="cpu", device_name="cpu", compute_dtype="float32", peak_flops=1.0,
        peak_flops_source="test", model_name="m", num_params=1, coordinates={"dp": rank},
        degrees={"dp": 2},
    )  # fmt: skip


def comm_span(start_us: float, end_us: float, *, seq: int, step: int = 1) -> SpanRecord:
    """plait's span of an all-reduce on group dp [0, 1] (times µs after BASE_NS)."""
    return SpanRecord(
        name="all_reduce",
        kind="comm",
        start_ns=BASE_NS + int(start_us * 1000),
        end_ns=BASE_NS + int(end_us * 1000),
        step=step,
        attributes={
            "plait.comm.op": "all_reduce",
            "plait.comm.group": "dp",
            "plait.comm.group_ranks": [0, 1],
            "plait.comm.seq": seq,
            "plait.step": step,
        },
    )


def cpu_trace(ops: list[tuple[str, str, int, float, float]], steps: dict[int, tuple[float, float]],
              base_ns: int = BASE_NS, pid: int = HOST_PID) -> dict:  # fmt: skip
    """A CPU trace: (name, category, tid, start µs, duration µs) events and step annotations."""
    events = [_x(f"ProfilerStep#{s}", "user_annotation", pid, pid, start, dur)
              for s, (start, dur) in steps.items()]  # fmt: skip
    events += [_x(name, cat, pid, tid, start, dur) for name, cat, tid, start, dur in ops]
    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "ts": 0,
                   "args": {"name": "thread (python)"}})  # fmt: skip
    return {"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": events}
