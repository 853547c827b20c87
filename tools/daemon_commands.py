"""Operator commands for the node daemon: `plait daemon`, `status`, `top` and `trace`.

Every client command takes `--host` several times (one daemon per node) and aggregates: ranks
are listed from all hosts, job MFU adds achieved and peak FLOP/s across hosts, traces are
merged on one timeline. Without `--host`, the address is `$PLAIT_DAEMON` or the default.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import grpc
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from plait.core.telemetry import DEFAULT_DAEMON_ADDRESS, resolve_daemon_address
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc

app = typer.Typer(help="The node daemon and the commands that query it.")
console = Console()

Hosts = Annotated[
    list[str] | None,
    typer.Option(
        "--host", help="daemon address host:port (repeat for several nodes); default $PLAIT_DAEMON"
    ),
]
RPC_TIMEOUT_SECONDS = 10.0


def _hosts(hosts: Sequence[str] | None) -> list[str]:
    return list(hosts) if hosts else [resolve_daemon_address()]


def _stub(host: str) -> tuple[grpc.Channel, daemon_pb2_grpc.DaemonStub]:
    channel = grpc.insecure_channel(host)
    return channel, daemon_pb2_grpc.DaemonStub(channel)


def _call_all(hosts: list[str], call: object) -> dict[str, object]:
    """`call(stub)` on every host concurrently; a failing host maps to its `grpc.RpcError`."""

    def one(host: str) -> object:
        channel, stub = _stub(host)
        try:
            return call(stub)  # type: ignore[operator]
        except grpc.RpcError as exc:
            return exc
        finally:
            channel.close()

    with ThreadPoolExecutor(max_workers=max(len(hosts), 1)) as pool:
        return dict(zip(hosts, pool.map(one, hosts), strict=True))


def _error_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"


# --------------------------------------------------------------------------------------------
# plait daemon
# --------------------------------------------------------------------------------------------


@app.command()
def daemon(
    bind: Annotated[
        str, typer.Option("--bind", help="address to listen on (loopback by default)")
    ] = DEFAULT_DAEMON_ADDRESS,
    window_steps: Annotated[int, typer.Option(help="steps kept per rank", min=1)] = 512,
    window_spans: Annotated[int, typer.Option(help="spans kept per rank", min=1)] = 50_000,
    reflection: Annotated[bool, typer.Option(help="serve gRPC reflection")] = True,
    grace: Annotated[float, typer.Option(help="seconds in-flight calls get at shutdown")] = 5.0,
) -> None:
    """Run the node daemon (OTLP receiver, plait.v1, health) until SIGTERM or Ctrl-C."""
    from plait.daemon.server import DaemonServer, serve

    try:
        server = DaemonServer(
            bind,
            window_steps=window_steps,
            window_spans=window_spans,
            reflection_enabled=reflection,
        )
    except (OSError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    console.print(
        f"plait daemon listening on [bold]{server.address}[/bold] "
        f"(ranks export with telemetry.daemon = {server.address!r} or PLAIT_DAEMON)",
        highlight=False,
    )
    serve(server, grace=grace)
    console.print("plait daemon stopped")


# --------------------------------------------------------------------------------------------
# plait status
# --------------------------------------------------------------------------------------------


@app.command()
def status(hosts: Hosts = None, job: Annotated[str, typer.Option(help="job id")] = "") -> None:
    """Show each daemon's state and the ranks reporting to it."""
    targets = _hosts(hosts)

    def query(stub: daemon_pb2_grpc.DaemonStub) -> tuple[object, object]:
        return (
            stub.Status(daemon_pb2.StatusRequest(), timeout=RPC_TIMEOUT_SECONDS),
            stub.ListRanks(daemon_pb2.ListRanksRequest(job_id=job), timeout=RPC_TIMEOUT_SECONDS),
        )

    results = _call_all(targets, query)
    daemons = Table(title="daemons")
    for column in ("host", "version", "uptime", "jobs", "ranks", "spans", "metric points"):
        daemons.add_column(column)
    ranks = Table(title="ranks")
    for column in ("job", "rank", "host", "pid", "device", "peak TFLOP/s", "mesh", "steps"):
        ranks.add_column(column)
    failed = False
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            failed = True
            daemons.add_row(host, f"[red]{_error_text(result)}[/red]", "", "", "", "", "")
            continue
        state, listing = result  # type: ignore[misc]
        daemons.add_row(
            host,
            state.version,
            f"{state.uptime_seconds:.0f}s",
            ", ".join(state.job_ids) or "-",
            str(state.ranks),
            str(state.spans_received),
            str(state.metric_points_received),
        )
        for info in listing.ranks:
            mesh = " ".join(f"{a}={c}" for a, c in sorted(info.coordinates.items()))
            ranks.add_row(
                info.job_id,
                str(info.rank),
                info.host,
                str(info.pid),
                f"{info.device} {info.device_name}",
                f"{info.peak_flops / 1e12:.3f} ({info.peak_flops_source})",
                mesh,
                str(info.steps_received),
            )
    console.print(daemons)
    console.print(ranks)
    if failed:
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------
# plait top
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobSummary:
    """One job across daemons: achieved and peak FLOP/s add up, the slowest step counts."""

    job_id: str
    ranks_reporting: int
    world_size: int
    step: int
    tokens_per_second: float
    model_flops_per_second: float
    peak_flops: float
    step_seconds: float

    @property
    def mfu(self) -> float:
        return self.model_flops_per_second / self.peak_flops if self.peak_flops > 0 else 0.0


def aggregate_jobs(responses: Sequence[daemon_pb2.GetMetricsResponse]) -> list[JobSummary]:
    """Combine the per-daemon job figures of several hosts (see `plait.daemon.mfu`)."""
    by_job: dict[str, list] = {}
    for response in responses:
        for job in response.jobs:
            by_job.setdefault(job.job_id, []).append(job)
    return [
        JobSummary(
            job_id=job_id,
            ranks_reporting=sum(j.ranks_reporting for j in jobs),
            world_size=max(j.world_size for j in jobs),
            step=max(j.step for j in jobs),
            tokens_per_second=sum(j.tokens_per_second for j in jobs),
            model_flops_per_second=sum(j.model_flops_per_second for j in jobs),
            peak_flops=sum(j.peak_flops for j in jobs),
            step_seconds=max(j.step_seconds for j in jobs),
        )
        for job_id, jobs in sorted(by_job.items())
    ]


def _bytes(value: int) -> str:
    if value < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024  # type: ignore[assignment]
    return str(value)


def render_top(latest: dict[str, daemon_pb2.GetMetricsResponse | str]) -> Group:
    """The `plait top` screen for the latest response (or error text) of each host."""
    responses = [r for r in latest.values() if not isinstance(r, str)]
    jobs = Table(title="jobs")
    for column in ("job", "ranks", "step", "tokens/s", "TFLOP/s", "MFU", "step time"):
        jobs.add_column(column, justify="right")
    for job in aggregate_jobs(responses):
        jobs.add_row(
            job.job_id,
            f"{job.ranks_reporting}/{job.world_size}",
            str(job.step),
            f"{job.tokens_per_second:,.0f}",
            f"{job.model_flops_per_second / 1e12:.3f}",
            f"{job.mfu:.1%}",
            f"{job.step_seconds * 1e3:.1f} ms",
        )
    ranks = Table(title="ranks")
    columns = ("host", "job", "rank", "step", "tokens/s", "MFU", "step time", "comm", "data")
    for column in (*columns, "memory", "CPU"):
        ranks.add_column(column, justify="right")
    rows = sorted(
        (r for response in responses for r in response.ranks), key=lambda r: (r.job_id, r.rank)
    )
    for r in rows:
        memory = r.device_memory_bytes if r.device_memory_bytes >= 0 else r.memory_rss_bytes
        ranks.add_row(
            r.host,
            r.job_id,
            str(r.rank),
            str(r.step),
            f"{r.tokens_per_second:,.0f}",
            f"{r.mfu:.1%}",
            f"{r.step_seconds * 1e3:.1f} ms",
            f"{r.comm_share:.0%}",
            f"{r.data_wait_seconds * 1e3:.1f} ms",
            _bytes(memory),
            f"{r.cpu_percent:.0f}%" if r.cpu_percent >= 0 else "-",
        )
    hosts = Table(title="hosts")
    for column in ("host", "CPU", "memory", "net out", "net in"):
        hosts.add_column(column, justify="right")
    for address, response in latest.items():
        if isinstance(response, str):
            hosts.add_row(address, f"[red]{response}[/red]", "", "", "")
            continue
        h = response.host
        hosts.add_row(
            f"{h.hostname} ({address})",
            f"{h.cpu_percent:.0f}% of {h.cpu_count}",
            f"{_bytes(h.memory_used_bytes)} / {_bytes(h.memory_total_bytes)}",
            f"{_bytes(int(h.net_sent_bytes_per_second))}/s",
            f"{_bytes(int(h.net_recv_bytes_per_second))}/s",
        )
    return Group(jobs, ranks, hosts)


class _Follower:
    """Keeps the latest StreamMetrics response of one daemon, reconnecting after errors."""

    def __init__(self, host: str, request: daemon_pb2.StreamMetricsRequest) -> None:
        self.host, self.request = host, request
        self.latest: daemon_pb2.GetMetricsResponse | str = "connecting"
        self._stop = threading.Event()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name=f"top-{host}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            channel, stub = _stub(self.host)
            try:
                self._call = stub.StreamMetrics(self.request)
                for response in self._call:
                    self.latest = response
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    self.latest = _error_text(exc)
            finally:
                channel.close()
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()


@app.command()
def top(
    hosts: Hosts = None,
    job: Annotated[str, typer.Option(help="job id (default: every job)")] = "",
    interval: Annotated[float, typer.Option(help="seconds between refreshes", min=0.1)] = 1.0,
    window_steps: Annotated[int, typer.Option(help="steps averaged per figure", min=0)] = 20,
    once: Annotated[bool, typer.Option("--once", help="print one snapshot and exit")] = False,
) -> None:
    """Live per-rank table: step, tokens/s, MFU, step time, communication share, memory."""
    targets = _hosts(hosts)
    if once:
        results = _call_all(
            targets,
            lambda stub: stub.GetMetrics(
                daemon_pb2.GetMetricsRequest(job_id=job, window_steps=window_steps),
                timeout=RPC_TIMEOUT_SECONDS,
            ),
        )
        latest = {
            h: _error_text(r) if isinstance(r, grpc.RpcError) else r for h, r in results.items()
        }
        console.print(render_top(latest))  # type: ignore[arg-type]
        if any(isinstance(r, str) for r in latest.values()):
            raise typer.Exit(1)
        return
    request = daemon_pb2.StreamMetricsRequest(
        job_id=job, window_steps=window_steps, interval_seconds=interval
    )
    followers = [_Follower(host, request) for host in targets]
    try:
        with Live(console=console, refresh_per_second=max(1.0, 1.0 / interval)) as live:
            while True:
                live.update(render_top({f.host: f.latest for f in followers}))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        for follower in followers:
            follower.stop()


# --------------------------------------------------------------------------------------------
# plait trace
# --------------------------------------------------------------------------------------------


@app.command()
def trace(
    hosts: Hosts = None,
    seconds: Annotated[
        float, typer.Option(help="capture spans starting in the next N seconds; 0 = the window")
    ] = 5.0,
    output: Annotated[Path, typer.Option("-o", "--output", help="Chrome trace JSON to write")] = (
        Path("trace.json")
    ),
    job: Annotated[str, typer.Option(help="job id (default: every job)")] = "",
    ranks: Annotated[list[int] | None, typer.Option("--rank", help="only these ranks")] = None,
) -> None:
    """Capture the ranks' spans as a Chrome trace (open it in https://ui.perfetto.dev)."""
    from plait.daemon.chrome_trace import merge_traces

    targets = _hosts(hosts)
    if seconds > 0:
        console.print(f"capturing {seconds:g}s of spans from {', '.join(targets)} …")
    request = daemon_pb2.CaptureTraceRequest(seconds=seconds, job_id=job, ranks=ranks or [])
    results = _call_all(
        targets, lambda stub: stub.CaptureTrace(request, timeout=seconds + RPC_TIMEOUT_SECONDS)
    )
    documents, span_count, failed = [], 0, False
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            console.print(f"[red]{host}: {_error_text(result)}[/red]", highlight=False)
            failed = True
            continue
        documents.append(json.loads(result.chrome_trace_json))  # type: ignore[attr-defined]
        span_count += result.span_count  # type: ignore[attr-defined]
    merged = merge_traces(documents)
    output.write_text(json.dumps(merged))
    pids = sorted({e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"})
    console.print(
        f"wrote {span_count} spans from ranks {pids} to {output} (open in https://ui.perfetto.dev)"
    )
    if failed:
        raise typer.Exit(1)
