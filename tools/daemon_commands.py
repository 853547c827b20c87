"""Operator commands for the node daemon: `plait daemon`, `status`, `top`, `bottleneck`, `trace`.

Every client command takes `--host` several times (one daemon per node) and aggregates: ranks
are listed from all hosts, job MFU adds achieved and peak FLOP/s across hosts, stragglers are
scored against the medians of all hosts' ranks, hang reports are merged per collective, traces
are merged on one timeline. Without `--host`, the address is `$PLAIT_DAEMON` or the default.
A daemon that requires TLS and a token is reached with `$PLAIT_DAEMON_CA_CERT` and
`$PLAIT_DAEMON_TOKEN` (and `$PLAIT_DAEMON_CLIENT_CERT`/`_KEY` for mutual TLS).
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

from plait.core.mfu import CALIBRATION_ADVICE, format_mfu, is_calibration_error, mfu
from plait.core.telemetry import DEFAULT_DAEMON_ADDRESS, DaemonClientAuth, resolve_daemon_address
from plait.daemon.hangs import Hang, merge_hangs
from plait.daemon.service import hang_from_message, job_advice, rescore_stragglers
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc, metrics_pb2

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
    channel = DaemonClientAuth.from_env().channel(host)
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
    tls_cert: Annotated[
        Path | None, typer.Option(help="server certificate (PEM); required off loopback")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="server private key (PEM)")] = None,
    client_ca: Annotated[
        Path | None, typer.Option(help="CA that client certificates must chain to (mutual TLS)")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="file holding the bearer token every call must send ($PLAIT_DAEMON_TOKEN)"
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option("--insecure", help="allow a non-loopback bind without TLS and token"),
    ] = False,
    max_message_mb: Annotated[float, typer.Option(help="largest request accepted", min=0.1)] = 16,
    ingest_capacity: Annotated[
        int, typer.Option(help="spans + metric points stored at once before dropping", min=1)
    ] = 200_000,
    max_streams: Annotated[
        int | None, typer.Option(help="concurrent streams/trace captures (default 3/4 of workers)")
    ] = None,
    hang_timeout: Annotated[
        float, typer.Option(help="seconds a partly entered collective may wait", min=0.1)
    ] = 60.0,
    straggler_threshold: Annotated[
        float, typer.Option(help="flag ranks this much slower than the median", min=0.0)
    ] = 0.2,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(help="forward upstream over OTLP/gRPC (default $OTEL_EXPORTER_OTLP_ENDPOINT)"),
    ] = None,
    prometheus: Annotated[
        str | None, typer.Option(help="serve Prometheus /metrics on host:port, e.g. 127.0.0.1:9464")
    ] = None,
    calibrate: Annotated[
        bool,
        typer.Option(help="measure this host's CPU peak FLOP/s at start unless it is cached"),
    ] = True,
) -> None:
    """Run the node daemon (OTLP receiver, plait.v1, health) until SIGTERM or Ctrl-C."""
    import os

    from plait.daemon.security import SecurityConfig, SecurityError
    from plait.daemon.server import DaemonServer, serve

    if otlp_endpoint is None and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        otlp_endpoint = ""  # the exporter reads the standard variables
    try:
        server = DaemonServer(
            bind,
            window_steps=window_steps,
            window_spans=window_spans,
            reflection_enabled=reflection,
            security=SecurityConfig.create(
                tls_cert=tls_cert,
                tls_key=tls_key,
                client_ca=client_ca,
                token_file=token_file,
                insecure=insecure,
            ),
            max_message_bytes=int(max_message_mb * 2**20),
            ingest_capacity=ingest_capacity,
            max_streams=max_streams,
            hang_timeout=hang_timeout,
            straggler_threshold=straggler_threshold,
            otlp_endpoint=otlp_endpoint,
            prometheus=prometheus,
        )
    except (OSError, RuntimeError, SecurityError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    if calibrate:
        # Before any rank starts, so ranks of this host read the cache instead of measuring.
        from plait.tools.calibrate_commands import report_calibration

        report_calibration(console)
    console.print(
        f"plait daemon listening on [bold]{server.address}[/bold] "
        f"(ranks export with telemetry.daemon = {server.address!r} or PLAIT_DAEMON); "
        f"{server.nvml.status}",
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
    columns = ("host", "version", "uptime", "jobs", "ranks", "spans", "metric points", "dropped")
    for column in (*columns, "rejected", "GPUs", "exporters"):
        daemons.add_column(column)
    rejects = Table(title="rejected at the door (bad attributes; not stored, not forwarded)")
    for column in ("host", "reason", "items"):
        rejects.add_column(column)
    forwarding = Table(title="forwarding upstream")
    for column in ("host", "endpoint", "forwarded", "retries", "queued", "dropped"):
        forwarding.add_column(column)
    ranks = Table(title="ranks")
    for column in ("job", "rank", "host", "pid", "device", "peak TFLOP/s", "mesh", "steps"):
        ranks.add_column(column)
    failed = False
    hang_reports: list[Hang] = []
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            failed = True
            daemons.add_row(host, f"[red]{_error_text(result)}[/red]", *[""] * 9)
            continue
        state, listing = result  # type: ignore[misc]
        hang_reports.extend(hang_from_message(h) for h in state.hangs)
        daemons.add_row(
            host,
            state.version,
            f"{state.uptime_seconds:.0f}s",
            ", ".join(state.job_ids) or "-",
            str(state.ranks),
            str(state.spans_received),
            str(state.metric_points_received),
            f"{state.spans_dropped} spans, {state.metric_points_dropped} points, "
            f"{state.calls_rejected} calls refused",
            f"{state.spans_rejected} spans, {state.metric_points_rejected} points",
            state.gpu_collector,
            ", ".join(state.exporters) or "-",
        )
        for reason, count in sorted(state.rejected_by_reason.items()):
            rejects.add_row(host, reason, str(count))
        if state.HasField("forwarder"):
            f = state.forwarder
            dropped = ", ".join(f"{r}: {n}" for r, n in sorted(f.dropped_by_reason.items()))
            forwarding.add_row(
                host,
                f.endpoint,
                f"{f.forwarded_requests} requests",
                str(f.retries),
                f"{f.queued_requests} ({_bytes(f.queued_bytes)} of "
                f"{_bytes(f.queue_capacity_bytes)})",
                f"{f.dropped_spans} spans, {f.dropped_metric_points} points"
                + (f" ({dropped})" if dropped else ""),
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
    if rejects.row_count:
        console.print(rejects)
    if forwarding.row_count:
        console.print(forwarding)
    hangs = render_hangs(hang_reports)
    if hangs is not None:
        console.print(hangs)
    if failed:
        raise typer.Exit(1)


def render_hangs(reports: list[Hang]) -> Table | None:
    """The hangs of all daemons, merged per collective (None when there are none)."""
    merged = merge_hangs(reports)
    if not merged:
        return None
    table = Table(title="[red]collective hangs[/red]")
    for column in ("job", "group", "op", "seq", "waiting", "entered", "missing"):
        table.add_column(column)
    for hang in merged:
        missing = [str(r) for r in hang.missing_ranks]
        missing += [f"{r} (no daemon sees it)" for r in hang.unreported_ranks]
        table.add_row(
            hang.job_id,
            f"{hang.group} {list(hang.group_ranks)}",
            f"{hang.op} ({hang.purpose})" if hang.purpose else hang.op,
            str(hang.seq),
            f"{hang.waiting_seconds:.1f}s",
            ", ".join(map(str, hang.entered_ranks)) or "-",
            ", ".join(missing),
        )
    return table


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
        return mfu(self.model_flops_per_second, self.peak_flops)


def aggregate_jobs(responses: Sequence[daemon_pb2.GetMetricsResponse]) -> list[JobSummary]:
    """Combine the per-daemon job figures of several hosts (see `plait.core.mfu`)."""
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
            format_mfu(job.mfu),
            f"{job.step_seconds * 1e3:.1f} ms",
        )
    ranks = Table(title="ranks")
    columns = ("host", "job", "rank", "step", "tokens/s", "MFU", "step time", "comm", "data")
    for column in (*columns, "memory", "CPU", "GPU"):
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
            format_mfu(r.mfu),
            f"{r.step_seconds * 1e3:.1f} ms",
            f"{r.comm_share:.0%}",
            f"{r.data_wait_seconds * 1e3:.1f} ms",
            _bytes(memory),
            f"{r.cpu_percent:.0f}%" if r.cpu_percent >= 0 else "-",
            f"{r.device_utilization:.0%}" if r.device_utilization >= 0 else "-",
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
    wrong_peaks = [f"{r.job_id}/{r.rank}" for r in rows if is_calibration_error(r.mfu)]
    if any(is_calibration_error(job.mfu) for job in aggregate_jobs(responses)) or wrong_peaks:
        advice = f"[red]calibration error[/red] ({', '.join(wrong_peaks) or 'job'}): "
        return Group(jobs, ranks, hosts, advice + CALIBRATION_ADVICE)
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
# plait bottleneck
# --------------------------------------------------------------------------------------------

BOTTLENECK_COLUMNS = (
    ("compute", "compute_seconds"),
    ("exposed comm", "exposed_comm_seconds"),
    ("data", "data_wait_seconds"),
    ("bubble", "pipeline_bubble_seconds"),
    ("optimizer", "optimizer_seconds"),
    ("host/other", "host_other_seconds"),
)


def write_bottleneck_png(ranks: Sequence[metrics_pb2.BottleneckBreakdown], path: Path) -> None:
    """A stacked bar per rank: mean seconds per step in each class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.job_id}/{r.rank}" for r in ranks]
    figure, axes = plt.subplots(figsize=(max(4.0, 0.6 * len(ranks) + 2), 4))
    bottom = [0.0] * len(ranks)
    for label, attribute in BOTTLENECK_COLUMNS:
        values = [getattr(r, attribute) * 1e3 for r in ranks]
        axes.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.set_ylabel("ms per step")
    axes.set_xlabel("job/rank")
    axes.set_title("where each rank's step time goes")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


@app.command()
def bottleneck(
    hosts: Hosts = None,
    job: Annotated[str, typer.Option(help="job id (default: every job)")] = "",
    window_steps: Annotated[int, typer.Option(help="steps averaged per rank", min=0)] = 20,
    threshold: Annotated[
        float, typer.Option(help="flag ranks this much slower than the median", min=0.0)
    ] = 0.2,
    png: Annotated[Path | None, typer.Option("--png", help="write a stacked bar chart")] = None,
) -> None:
    """Per-rank breakdown of step time (compute, exposed comm, data, bubble, optimizer, host)."""
    targets = _hosts(hosts)
    request = daemon_pb2.GetBottleneckRequest(
        job_id=job, window_steps=window_steps, straggler_threshold=threshold
    )
    results = _call_all(
        targets, lambda stub: stub.GetBottleneck(request, timeout=RPC_TIMEOUT_SECONDS)
    )
    responses: list[daemon_pb2.GetBottleneckResponse] = []
    failed = False
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            console.print(f"[red]{host}: {_error_text(result)}[/red]", highlight=False)
            failed = True
        else:
            responses.append(result)  # type: ignore[arg-type]
    ranks = sorted((r for resp in responses for r in resp.ranks), key=lambda r: (r.job_id, r.rank))
    table = Table(title="bottleneck (mean ms per step)")
    for column in ("job", "rank", "steps", "step", *(c for c, _ in BOTTLENECK_COLUMNS)):
        table.add_column(column, justify="right")
    table.add_column("dominant")
    for r in ranks:
        cells = [f"{getattr(r, attribute) * 1e3:.1f}" for _, attribute in BOTTLENECK_COLUMNS]
        table.add_row(
            r.job_id, str(r.rank), str(r.steps), f"{r.step_seconds * 1e3:.1f}", *cells, r.dominant
        )
    console.print(table)
    scores = rescore_stragglers(responses, threshold)
    if scores:
        stragglers = Table(title=f"stragglers (flagged above +{threshold:.0%} of the median)")
        for column in ("job", "rank", "host", "median step", "median compute", "score", ""):
            stragglers.add_column(column, justify="right")
        for s in scores:
            stragglers.add_row(
                s.job_id,
                str(s.rank),
                s.host,
                f"{s.median_step_seconds * 1e3:.1f} ms ({s.step_score:+.0%})",
                f"{s.median_compute_seconds * 1e3:.1f} ms ({s.compute_score:+.0%})",
                f"{max(s.step_score, s.compute_score):+.2f}",
                "[red]STRAGGLER[/red]" if s.flagged else "",
            )
        console.print(stragglers)
    by_job: dict[str, list[metrics_pb2.BottleneckBreakdown]] = {}
    for r in ranks:
        by_job.setdefault(r.job_id, []).append(r)
    for job_id, job_ranks in sorted(by_job.items()):
        dominant, text = job_advice(job_ranks)
        if dominant:
            console.print(f"job {job_id} — [bold]{dominant}[/bold]: {text}", highlight=False)
    if png is not None and ranks:
        write_bottleneck_png(ranks, png)
        console.print(f"wrote {png}")
    if failed:
        raise typer.Exit(1)


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
