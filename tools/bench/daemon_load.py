"""Daemon under load: ingest rate and query latency with exporters flooding and clients querying.

    python tools/bench/daemon_load.py [--clients 32] [--ranks 2] [--flooders 3] [--seconds 10]
                                      [--query-interval 0] [--web-streams 0]

The daemon runs in its own process (as in production). `--ranks` processes export like
training ranks: every 50 ms a step with five phase spans and three collectives, through the
real telemetry plugin and its exporter, heartbeat included. `--flooders` processes are
exporters with no training to wait for: each sends a rank's spans (steps, phases and
collectives, as plait's exporter encodes them) back to back, so the daemon ingests as fast as
it can. `--clients` client threads each hold a `StreamMetrics` stream open (0.2 s interval)
and, meanwhile, issue `GetMetrics`, `GetBottleneck` and `Status` calls, timing each one: back
to back by default, or one round every `--query-interval` seconds (as `plait top` refreshes).
The clients run in `--client-processes` processes (each operator's `plait top` is a process of
its own; one process's GIL would time its own threads as much as the daemon). `--web-streams N`
serves the daemon's web page and holds N of its event streams open meanwhile (N browsers with
the page open), from a process of their own; run it with 0 and with 20 to compare.

The daemon process runs its interpreter as `plait daemon` does (`plait.daemon.interpreter`:
0.5 ms lock hand-overs, automatic collection off and a full collection every ten minutes);
`--default-switch-interval` and `--automatic-gc` run it without either, for comparison.
Reported: calls, errors, p50/p99/max latency per method, the spans the daemon stored per second
while the clients ran (from its own counters), plus what it dropped, the daemon's garbage
collections while the clients ran (count, longest pause, total), the daemon process's CPU time
per stored span (what one core would ingest, whatever the machine's load) and the load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
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


def export_like_a_rank(
    address: str, rank: int, world_size: int, seconds: float, done: Any = None
) -> int:
    """Steps of synthetic spans through the telemetry plugin for `seconds`, or until `done` (an
    event) is set; returns steps sent."""
    from plait.plugins.telemetry import make_plugin

    plugins = Plugins.create(autoload=False, builtins=(), extra=[("instant", _InstantBackend())])
    plugins.register(make_plugin(), "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": address}}))
    plugins.job_start(_job(rank, world_size, "load"))
    comm = Comm(plugins)
    group = Group(name="dp", ranks=tuple(range(world_size)))
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline and not (done is not None and done.is_set()):
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


def encoded_rank_requests(
    rank: int, world_size: int, steps: int = 200, comm_per_step: int = 11
) -> list[tuple[bytes, int]]:
    """A rank's spans for `steps` steps as plait's exporter writes them: (request, spans)."""
    from plait.daemon.peak_flops import PeakFlops
    from plait.daemon.telemetry_resource import resource_attributes
    from plait.plugins.telemetry.comm_records import CommRecord
    from plait.plugins.telemetry.exporter import SpanExporter

    sent: list[bytes] = []
    exporter = SpanExporter(
        send=sent.append,
        resource=resource_attributes(_job(rank, world_size, "flood"), PeakFlops(1e12, "bench")),
        scope=("plait.telemetry", "bench"),
        batch_delay=3600.0,
        max_batch=2048,
    )
    base = time.time_ns()
    for step in range(steps):
        start = base + step * STEP_MS * 1_000_000
        bounds = [start + i * STEP_MS * 1_000_000 // len(PHASES) for i in range(len(PHASES) + 1)]
        phases = tuple(
            PhaseSpan(name=name, start_ns=bounds[i], end_ns=bounds[i + 1])
            for i, name in enumerate(PHASES)
        )
        exporter.put_step(
            StepReport(
                step=step, loss=1.0, tokens=1024, step_seconds=STEP_MS / 1e3,
                data_wait_seconds=0.001, model_flops=6e6, lr=1e-3, start_ns=start,
                end_ns=bounds[-1], spans=phases,
            )
        )  # fmt: skip
        exporter.put_comm(
            [
                CommRecord(
                    op="all_reduce",
                    nbytes=4 << 20,
                    dtype=torch.float32,
                    group_name="dp",
                    group_ranks=tuple(range(world_size)),
                    seq=step * comm_per_step + i,
                    purpose="grad_bucket",
                    peer=None,
                    async_op=True,
                    step=step,
                    start_ns=bounds[2] + i * 1000,
                    end_ns=bounds[3],
                )
                for i in range(comm_per_step)
            ]
        )
    exporter.shutdown(60)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    return [
        (raw, sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans))
        for raw in sent
        for message in (ExportTraceServiceRequest.FromString(raw),)
    ]


def flood(
    address: str,
    rank: int,
    world_size: int,
    seconds: float,
    ready: Any,  # multiprocessing.Event: set once the requests are built
    go: Any,  # multiprocessing.Event: start sending
    out: Any,  # multiprocessing.Queue: the spans sent, once done
) -> None:
    """Send one rank's encoded spans back to back for `seconds` after `go`."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    from plait.plugins.telemetry.rank_telemetry import TRACE_EXPORT_METHOD

    requests = encoded_rank_requests(rank, world_size, steps=2000)  # fresh steps for a while
    ready.set()
    go.wait()
    sent = 0
    with grpc.insecure_channel(address) as channel:
        export = channel.unary_unary(
            TRACE_EXPORT_METHOD,
            request_serializer=None,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for raw, spans in requests:
                export(raw, timeout=30)
                sent += spans
    out.put(sent)


def _job(rank: int, world_size: int, job_id: str) -> JobInfo:
    return JobInfo(
        job_id=job_id, rank=rank, local_rank=rank, world_size=world_size, host="bench",
        degrees={"dp": world_size}, coordinates={"dp": rank}, device="cpu", device_name="cpu",
        compute_dtype="float32", model_name="bench", num_params=1000, flops_per_token=6000.0,
        tokens_per_step=1024,
    )  # fmt: skip


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


def run_clients(
    address: str, clients: int, seconds: float, query_interval: float = 0.0
) -> LoadResult:
    """`clients` threads, each streaming and querying for `seconds` (a round of queries every
    `query_interval` seconds, 0: back to back); every error is kept."""
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
                next_round = time.monotonic() + query_interval
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
                time.sleep(max(0.0, min(next_round, deadline) - time.monotonic()))
            stream.cancel()
            follower.join(timeout=5)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return result


class _EveryRequestComputes:
    """`--unshared-queries`: the daemon as it was before identical queries shared one
    computation (`plait.daemon.shared_answers`), for comparison in the same run."""

    def get(self, key: Any, compute: Any) -> Any:
        del key
        return compute()


class CollectorPauses:
    """Every garbage collection of this process: (monotonic start, seconds, generation)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.monotonic()
        else:
            self.pauses.append((self._began, time.monotonic() - self._began, info["generation"]))


def _serve(
    address_queue: mp.Queue,  # type: ignore[type-arg]
    stop: mp.Event,  # type: ignore[type-arg]
    ingest_workers: int,
    shared_queries: bool = True,
    switch_interval: bool = True,
    scheduled_collections: bool = True,
    web: bool = False,
) -> None:
    """The daemon's process: its address and its page's URL (None without `web`), then (at
    `stop`) its collector's pauses, on the queue."""
    from plait.daemon.interpreter import SWITCH_INTERVAL_SECONDS, serving_interpreter
    from plait.daemon.server import DaemonServer

    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    page = "127.0.0.1:0" if web else None
    with DaemonServer("127.0.0.1:0", ingest_workers=ingest_workers, web=page) as server:
        if not shared_queries:
            server.service.answers = _EveryRequestComputes()  # type: ignore[assignment]
        with serving_interpreter(
            scheduled_collections=scheduled_collections,
            switch_interval_seconds=SWITCH_INTERVAL_SECONDS if switch_interval else None,
        ):
            address_queue.put((server.address, server.web.url if server.web else None))
            stop.wait()
    gc.callbacks.remove(pauses)
    address_queue.put(pauses.pauses)


def query_from_a_process(
    address: str,
    clients: int,
    seconds: float,
    query_interval: float,
    ready: Any,  # multiprocessing.Event: set once this process can start
    go: Any,  # multiprocessing.Event: start querying
    out: Any,  # multiprocessing.Queue: (latencies, errors, stream messages), once done
) -> None:
    """`run_clients` in a process of its own."""
    ready.set()
    go.wait()
    result = run_clients(address, clients, seconds, query_interval)
    out.put((result.latencies, result.errors, result.stream_messages))


def follow_page_streams(
    url: str,
    streams: int,
    seconds: float,
    ready: Any,  # multiprocessing.Event: set once every stream is open
    go: Any,  # multiprocessing.Event: start counting
    out: Any,  # multiprocessing.Queue: the page updates received, once done
) -> None:
    """`streams` browsers' worth of the page's event streams, held open for `seconds` after `go`;
    puts how many page updates they received in all."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    received = [0] * streams
    connections = []
    for _ in range(streams):
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        connection.request("GET", "/events")
        connections.append(connection.getresponse())
    ready.set()
    go.wait()
    deadline = time.monotonic() + seconds

    def read(i: int) -> None:
        while time.monotonic() < deadline:
            line = connections[i].readline()
            if not line:
                return
            received[i] += line.startswith(b"event: snapshot")

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(streams)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=seconds + 30)
    out.put(sum(received))


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU seconds so far of process `pid` and of its children (ingest workers)."""
    try:
        process = psutil.Process(pid)
        own = process.cpu_times()
        children = [child.cpu_times() for child in process.children()]
    except psutil.Error:
        return float("nan"), float("nan")
    return own.user + own.system, sum(times.user + times.system for times in children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--flooders", type=int, default=3, help="exporters sending flat out")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--query-interval", type=float, default=0.0, help="seconds between query rounds"
    )
    parser.add_argument(
        "--ingest-workers", type=int, default=0, help="the daemon's ingest worker processes"
    )
    parser.add_argument(
        "--unshared-queries",
        action="store_true",
        help="every query computes its own answer (as before identical queries were shared)",
    )
    parser.add_argument(
        "--client-processes", type=int, default=1, help="processes the clients are spread over"
    )
    parser.add_argument(
        "--default-switch-interval",
        action="store_true",
        help="the daemon's interpreter hands its lock over every 5 ms (as before 0.5 ms)",
    )
    parser.add_argument(
        "--automatic-gc",
        action="store_true",
        help="the daemon's collector runs on CPython's own trigger (as before it was scheduled)",
    )
    parser.add_argument(
        "--web-streams",
        type=int,
        default=0,
        help="serve the web page and hold this many of its event streams open (browsers)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    addresses, stop = ctx.Queue(), ctx.Event()
    if not 1 <= args.client_processes <= args.clients:
        parser.error(f"--client-processes must be 1 to --clients ({args.clients})")
    daemon = ctx.Process(
        target=_serve,
        args=(
            addresses,
            stop,
            args.ingest_workers,
            not args.unshared_queries,
            not args.default_switch_interval,
            not args.automatic_gc,
            args.web_streams > 0,
        ),
    )
    daemon.start()
    address, page_url = addresses.get(timeout=60)
    # The ranks export until the measurement is over (a cap for a bench that breaks).
    measured = ctx.Event()
    ranks = [
        ctx.Process(
            target=export_like_a_rank, args=(address, r, args.ranks, args.seconds + 300, measured)
        )
        for r in range(args.ranks)
    ]
    sent_queue, go = ctx.Queue(), ctx.Event()
    ready = [ctx.Event() for _ in range(args.flooders)]
    flooders = [
        ctx.Process(
            target=flood,
            args=(address, r, args.flooders, args.seconds + 3, ready[r], go, sent_queue),
        )
        for r in range(args.flooders)
    ]
    shares = [
        args.clients // args.client_processes + (i < args.clients % args.client_processes)
        for i in range(args.client_processes)
    ]
    answers, query = ctx.Queue(), ctx.Event()
    querying = [ctx.Event() for _ in shares]
    queriers = [
        ctx.Process(
            target=query_from_a_process,
            args=(address, n, args.seconds, args.query_interval, querying[i], query, answers),
        )
        for i, n in enumerate(shares)
    ]
    page_updates, browsing = ctx.Queue(), ctx.Event()
    browsers = [
        ctx.Process(
            target=follow_page_streams,
            args=(page_url, args.web_streams, args.seconds, browsing, query, page_updates),
        )
        for _ in range(1 if page_url else 0)
    ]
    for process in ranks + flooders + queriers + browsers:
        process.start()
    for event in ready + querying + ([browsing] if browsers else []):
        event.wait(300)
    go.set()
    time.sleep(2)  # the ranks and flooders are exporting before the clients start

    def stored() -> int:
        with grpc.insecure_channel(address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            return stub.Status(daemon_pb2.StatusRequest(), timeout=30).spans_received

    before, began, cpu_before = stored(), time.perf_counter(), process_cpu_seconds(daemon.pid)
    window_start = time.monotonic()
    query.set()
    result = LoadResult()
    for _ in queriers:
        latencies, errors, stream_messages = answers.get(timeout=args.seconds + 300)
        for method, values in latencies.items():
            result.latencies.setdefault(method, []).extend(values)
        result.errors.extend(errors)
        result.stream_messages += stream_messages
    window_end = time.monotonic()
    updates = sum(page_updates.get(timeout=60) for _ in browsers)
    spans_stored = stored() - before
    ingest_rate = spans_stored / (time.perf_counter() - began)
    cpu_after = process_cpu_seconds(daemon.pid)
    daemon_cpu, workers_cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
    with grpc.insecure_channel(address) as channel:
        status = daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest())
    flooded = sum(sent_queue.get(timeout=120) for _ in flooders)
    measured.set()
    for process in ranks + flooders + queriers + browsers:
        process.join()
    stop.set()
    pauses = [
        (seconds, generation)
        for began_at, seconds, generation in addresses.get(timeout=60)
        if window_start <= began_at <= window_end
    ]
    daemon.join()
    longest = max(pauses, default=(0.0, 0))
    total_pause = sum(seconds for seconds, _ in pauses)

    pace = f"every {args.query_interval:g}s" if args.query_interval > 0 else "back to back"
    table = Table(
        title=f"{args.clients} clients ({args.client_processes} processes) querying {pace}, "
        f"{args.ranks} ranks and "
        f"{args.flooders} flooding exporters, {args.web_streams} web page streams, "
        f"{args.seconds:g}s"
    )
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
        f"{status.spans_dropped} dropped, {status.calls_rejected} calls refused; "
        f"{status.ingest_workers} ingest workers decoded {status.ingest_worker_requests:,} "
        f"requests ({status.ingest_worker_restarts} restarts)"
    )
    if browsers:
        console.print(
            f"web page: {args.web_streams} event streams received {updates:,} updates "
            f"({updates / max(args.web_streams, 1) / args.seconds:.2f} per stream per second)"
        )
    console.print(
        f"ingest while the clients ran: {ingest_rate:,.0f} spans/s stored "
        f"({args.flooders} flooding exporters sent {flooded:,} spans in all)"
    )
    console.print(
        f"daemon's garbage collections while the clients ran: {len(pauses)}, longest "
        f"{longest[0] * 1e3:.1f} ms (generation {longest[1]}), {total_pause * 1e3:.0f} ms in all "
        f"({'automatic' if args.automatic_gc else 'scheduled'}; "
        f"lock hand-overs every {5 if args.default_switch_interval else 0.5} ms)"
    )
    per_span = daemon_cpu / max(spans_stored, 1)
    console.print(
        f"daemon process CPU: {daemon_cpu / args.seconds:.0%} of a core, "
        f"{per_span * 1e6:.1f} µs per stored span (queries included) = "
        f"{1 / per_span if per_span > 0 else float('nan'):,.0f} spans per CPU-second; "
        f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, "
        f"{os.cpu_count()} CPUs"
    )
    if args.ingest_workers:
        worker_span = workers_cpu / max(spans_stored, 1)
        console.print(
            f"ingest workers' CPU: {workers_cpu / args.seconds:.0%} of a core in all, "
            f"{worker_span * 1e6:.1f} µs per stored span"
        )
    if args.json is not None:
        figures = {
            "cpus": os.cpu_count(),
            "settings": vars(args) | {"json": str(args.json)},
            "spans_stored_per_second": ingest_rate,
            "spans_received": status.spans_received,
            "spans_dropped": status.spans_dropped,
            "calls_refused": status.calls_rejected,
            "errors": len(result.errors),
            "web_page_updates": updates,
            "daemon_cpu_seconds": daemon_cpu,
            "gc": {
                "collections": len(pauses),
                "longest_pause_ms": longest[0] * 1e3,
                "total_pause_ms": total_pause * 1e3,
            },
            "ingest_workers_cpu_seconds": workers_cpu,
            "latency_ms": {
                method: {
                    "calls": len(values),
                    "p50": result.percentile(method, 0.50) * 1e3,
                    "p99": result.percentile(method, 0.99) * 1e3,
                    "max": max(values) * 1e3,
                }
                for method, values in sorted(result.latencies.items())
            },
        }
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
