"""Daemon under load: query latency with many clients streaming while ranks export.

    python tools/bench/daemon_load.py [--clients 32] [--ranks 2] [--seconds 10]

The daemon runs in its own process (as in production). `--ranks` processes export like
training ranks: every 50 ms a step with five phase spans and three collectives, through the
real telemetry plugin and OTLP exporters, heartbeat included. `--clients` client threads each
hold a `StreamMetrics` stream open (0.2 s interval) and, meanwhile, issue `GetMetrics`,
`GetBottleneck` and `Status` calls back to back, timing each one. Reported: calls, errors, and
p50/p99/max latency per method, plus what the daemon ingested and dropped.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch
from rich.console import Console
from rich.table import Table

from plait.core.comm import Comm, CompletedWork, Group
from plait.core.config import load_config
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.core.step import JobInfo, PhaseSpan, StepReport
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc

STEP_MS = 50
PHASES = ("data", "forward", "backward", "sync_gradients", "optimizer")


class _InstantBackend:
    @hookimpl(trylast=True)
    def plait_communicate(self, request: CommRequest) -> CompletedWork:
        return CompletedWork()


def export_like_a_rank(address: str, rank: int, world_size: int, seconds: float) -> int:
    """Steps of synthetic spans through the telemetry plugin for `seconds`; returns steps sent."""
    from plait.plugins.telemetry import make_plugin

    plugins = Plugins.create(autoload=False, builtins=(), extra=[("instant", _InstantBackend())])
    plugins.register(make_plugin(), "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": address}}))
    plugins.job_start(
        JobInfo(
            job_id="load",
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            host="bench",
            degrees={"dp": world_size},
            coordinates={"dp": rank},
            device="cpu",
            device_name="cpu",
            compute_dtype="float32",
            model_name="bench",
            num_params=1000,
            flops_per_token=6000.0,
            tokens_per_step=1024,
        )
    )
    comm = Comm(plugins)
    group = Group(name="dp", ranks=tuple(range(world_size)))
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        plugins.step_start(step)
        start = time.time_ns()
        for purpose in ("grad_bucket", "grad_bucket", "metrics"):
            comm.all_reduce(torch.zeros(16), group=group, purpose=purpose)
        time.sleep(STEP_MS / 1e3)
        end = time.time_ns()
        bounds = [start + i * (end - start) // len(PHASES) for i in range(len(PHASES) + 1)]
        spans = tuple(
            PhaseSpan(name=name, start_ns=bounds[i], end_ns=bounds[i + 1])
            for i, name in enumerate(PHASES)
        )
        plugins.step_end(
            StepReport(
                step=step,
                loss=1.0,
                tokens=1024,
                step_seconds=(end - start) / 1e9,
                data_wait_seconds=(bounds[1] - bounds[0]) / 1e9,
                model_flops=6e6,
                lr=1e-3,
                start_ns=start,
                end_ns=end,
                spans=spans,
            )
        )
        step += 1
    plugins.job_end()
    return step


@dataclass
class LoadResult:
    latencies: dict[str, list[float]] = field(default_factory=dict)  # method -> seconds
    errors: list[str] = field(default_factory=list)
    stream_messages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def percentile(self, method: str, q: float) -> float:
        values = sorted(self.latencies.get(method, []))
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


def run_clients(address: str, clients: int, seconds: float) -> LoadResult:
    """`clients` threads, each streaming and querying for `seconds`; every error is kept."""
    result = LoadResult()
    calls = {
        "GetMetrics": lambda stub: stub.GetMetrics(daemon_pb2.GetMetricsRequest(), timeout=10),
        "GetBottleneck": lambda stub: stub.GetBottleneck(
            daemon_pb2.GetBottleneckRequest(), timeout=10
        ),
        "Status": lambda stub: stub.Status(daemon_pb2.StatusRequest(), timeout=10),
    }
    start_together = threading.Barrier(clients)

    def client() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            stream = stub.StreamMetrics(daemon_pb2.StreamMetricsRequest(interval_seconds=0.2))

            def follow() -> None:
                try:
                    for _ in stream:
                        with result.lock:
                            result.stream_messages += 1
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        with result.lock:
                            result.errors.append(f"StreamMetrics: {exc.code().name}")

            follower = threading.Thread(target=follow, daemon=True)
            follower.start()
            start_together.wait()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for method, call in calls.items():
                    began = time.perf_counter()
                    try:
                        call(stub)
                    except grpc.RpcError as exc:
                        with result.lock:
                            result.errors.append(f"{method}: {exc.code().name}")
                        continue
                    elapsed = time.perf_counter() - began
                    with result.lock:
                        result.latencies.setdefault(method, []).append(elapsed)
            stream.cancel()
            follower.join(timeout=5)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return result


def _serve(address_queue: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    from plait.daemon.server import DaemonServer

    with DaemonServer("127.0.0.1:0") as server:
        address_queue.put(server.address)
        stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    addresses, stop = ctx.Queue(), ctx.Event()
    daemon = ctx.Process(target=_serve, args=(addresses, stop))
    daemon.start()
    address = addresses.get(timeout=60)
    ranks = [
        ctx.Process(target=export_like_a_rank, args=(address, r, args.ranks, args.seconds + 4))
        for r in range(args.ranks)
    ]
    for process in ranks:
        process.start()
    time.sleep(3)  # the ranks are exporting before the clients start
    result = run_clients(address, args.clients, args.seconds)
    with grpc.insecure_channel(address) as channel:
        status = daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest())
    for process in ranks:
        process.join()
    stop.set()
    daemon.join()

    table = Table(title=f"{args.clients} clients, {args.ranks} ranks exporting, {args.seconds:g}s")
    for column in ("method", "calls", "p50 ms", "p99 ms", "max ms", "mean ms"):
        table.add_column(column, justify="right")
    for method, values in sorted(result.latencies.items()):
        table.add_row(
            method,
            str(len(values)),
            f"{result.percentile(method, 0.50) * 1e3:.2f}",
            f"{result.percentile(method, 0.99) * 1e3:.2f}",
            f"{max(values) * 1e3:.2f}",
            f"{statistics.fmean(values) * 1e3:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"errors: {len(result.errors)} {sorted(set(result.errors))}; stream messages: "
        f"{result.stream_messages}; daemon: {status.spans_received} spans received, "
        f"{status.spans_dropped} dropped, {status.calls_rejected} calls refused"
    )


if __name__ == "__main__":
    main()
