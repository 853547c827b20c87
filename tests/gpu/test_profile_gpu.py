"""Profiling on CUDA through the control channel: the rank's client prepares torch.profiler off
the training thread and CUPTI still records the kernels, copies and launches of the steps it
was asked for; NCCL kernels count as communication; the allocator snapshot is delivered."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.multiprocessing as mp

from plait.core.step import JobInfo
from plait.daemon import trace_analysis
from plait.daemon.server import DaemonServer
from plait.plugins.telemetry.control_client import ControlClient
from plait.plugins.telemetry.profile_capture import new_profiler
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc

JOB = "gpu-profile"


def _job_info() -> JobInfo:
    return JobInfo(
        job_id=JOB, rank=0, local_rank=0, world_size=1, host="gpu-node", degrees={"dp": 1},
        coordinates={"dp": 0}, device="cuda:0", device_name=torch.cuda.get_device_name(0),
        compute_dtype="float32", model_name="mlp", num_params=1, flops_per_token=1.0,
        tokens_per_step=1,
    )  # fmt: skip


def test_a_cuda_capture_holds_kernels_copies_and_launches() -> None:
    with DaemonServer("127.0.0.1:0", host_interval=60.0) as server:
        channel = grpc.insecure_channel(server.address)
        client = ControlClient(channel=channel, info=_job_info(), flush_spans=lambda t: True,
                               interval=0.05)  # fmt: skip
        stop = threading.Event()

        def train() -> None:
            torch.cuda.set_device(0)
            model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                        torch.nn.Linear(2048, 512)).cuda()  # fmt: skip
            optimizer = torch.optim.AdamW(model.parameters())
            step = 0
            while not stop.is_set():
                client.step_started(step)
                batch = torch.randn(64, 512).to("cuda:0")  # a host-to-device copy per step
                model(batch).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                client.step_finished(step)
                step += 1

        def export() -> None:
            while not stop.wait(0.05):
                client.tick()

        threads = [threading.Thread(target=train), threading.Thread(target=export)]
        for thread in threads:
            thread.start()
        try:
            stub = control_pb2_grpc.ControlStub(channel)
            deadline = time.monotonic() + 120
            while client.polls < 2 or client.step < 3:
                assert time.monotonic() < deadline, "the client never polled"
                time.sleep(0.05)
            prepared = stub.PrepareProfile(
                control_pb2.ProfileRequest(job_id=JOB, steps=3, timeout_seconds=120)
            )
            response = stub.CollectProfile(
                control_pb2.CollectProfileRequest(
                    request_id=prepared.request_id, timeout_seconds=120
                )
            )
            memory = stub.Memory(control_pb2.MemoryRequest(job_id=JOB, step_wait_seconds=30))
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
            channel.close()
    assert [o.state for o in response.outcomes] == ["delivered"], response.outcomes
    document = json.loads(gzip.decompress(response.trace_json_gz))
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    categories = {e["cat"] for e in events}
    assert {"kernel", "gpu_memcpy", "cuda_runtime", "cpu_op"} <= categories, categories
    threads = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert any("stream" in name for name in threads), threads
    (figures,) = response.analysis.ranks
    assert figures.timeline == "cuda" and figures.steps == 3
    assert figures.compute_seconds > 0 and figures.memory_seconds >= 0
    assert figures.communication_total_seconds == 0  # one GPU, no collective
    assert figures.launches > 0 and figures.launch_cpu_seconds > 0
    kinds = {op.kind for op in figures.top_ops}
    assert "compute" in kinds
    total = (figures.compute_seconds + figures.communication_seconds + figures.memory_seconds
             + figures.idle_host_seconds + figures.idle_peer_wait_seconds)  # fmt: skip
    assert total == pytest.approx(figures.window_seconds, rel=1e-6)

    files = {f.name: f.data for f in memory.files}
    assert set(files) == {"memory.json", "snapshot.pickle"}, [o for o in memory.outcomes]
    report = json.loads(files["memory.json"])
    assert report["cuda"]["allocated_bytes"] > 0 and report["activations_saved_bytes"] > 0
    snapshot = pickle.loads(files["snapshot.pickle"])
    assert "segments" in snapshot and snapshot["device_traces"], snapshot.keys()


def _nccl_rank(rank: int, world_size: int, store_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda(),
        device_ids=[rank],
    )

    def step() -> None:
        model(torch.randn(128, 1024, device="cuda")).square().mean().backward()
        torch.cuda.synchronize()

    step()  # NCCL connects on the first collective
    profiler = new_profiler(f"cuda:{rank}", with_stack=False, record_shapes=False)
    profiler.prepare_trace()
    profiler.start_trace()
    with torch.autograd.profiler.record_function("ProfilerStep#1"):
        step()
    profiler.stop_trace()
    profiler.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.json"))
    dist.destroy_process_group()


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: NCCL runs no kernel for a single rank (it copies)",
)
def test_nccl_kernels_are_communication() -> None:
    with tempfile.TemporaryDirectory() as store_dir, tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_nccl_rank, args=(2, store_dir, out_dir), nprocs=2, join=True)
        documents = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in (0, 1)]
    for document in documents:
        events = [e for e in document["traceEvents"] if e.get("ph") == "X"]
        nccl = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
        assert nccl, sorted({e["name"] for e in events if e.get("cat") == "kernel"})
        assert all(trace_analysis.kernel_class(e) == "communication" for e in nccl)
        figures = trace_analysis.analyze_rank(events)
        assert figures.timeline == "cuda" and figures.steps == 1
        assert figures.communication_total_seconds > 0 and figures.compute_seconds > 0
        by_kind: dict[str, Any] = {op.name: op.kind for op in figures.top_ops}
        assert any(
            kind == "communication" for name, kind in by_kind.items() if "nccl" in name.lower()
        )
