"""`plait.observe` on a CUDA device: steps, phases and the step's own bounds are read from CUDA
events (no synchronisation in the loop), and the daemon's breakdown of them adds up."""

from __future__ import annotations

import grpc
import pytest
import torch

import plait
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc

CLASSES = ("compute", "exposed_comm", "data_wait", "pipeline_bubble", "optimizer", "host_other")


@pytest.mark.timeout(180)
def test_a_cuda_loop_is_timed_on_the_device() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(4096, 1024),
        *[torch.nn.Linear(1024, 1024) for _ in range(8)],
        torch.nn.Linear(1024, 4096),
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with DaemonServer("127.0.0.1:0", host_interval=0.5) as server:
        observer = plait.observe(model, optimizer=optimizer, daemon=server.address, job_id="gpu")
        ids = torch.randint(0, 4096, (16, 512), device="cuda")
        for _ in range(8):
            with observer.step() as step:
                logits = model(ids)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step.loss = loss
        observer.close()
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            metrics = stub.GetMetrics(daemon_pb2.GetMetricsRequest(job_id="gpu", window_steps=6))
            breakdown = stub.GetBottleneck(
                daemon_pb2.GetBottleneckRequest(job_id="gpu", window_steps=6)
            )
    (rank,) = metrics.ranks
    assert rank.step == 8 and 0 < rank.mfu <= 1 and rank.loss == pytest.approx(loss.item())
    (mine,) = breakdown.ranks
    assert sum(getattr(mine, f"{c}_seconds") for c in CLASSES) == pytest.approx(
        mine.step_seconds, rel=1e-6
    )
    # Device-timed: the matmuls dominate the step, not the host's kernel launches.
    assert mine.compute_seconds > 0.5 * mine.step_seconds, mine
