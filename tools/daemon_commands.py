"""Operator commands for the node daemon: `plait daemon`, `status`, `top`, `bottleneck`, `trace`.

Every client command takes `--host` several times (one daemon per node) and aggregates: ranks
are listed from all hosts, job MFU adds achieved and peak FLOP/s across hosts, stragglers are
scored against the medians of all hosts' ranks, hang reports are merged per collective, traces
are merged on one timeline. Without `--host`, the address is `$PLAIT_DAEMON` or the default.
A daemon that requires TLS and a token is reached with `$PLAIT_DAEMON_CA_CERT` and
`$PLAIT_DAEMON_TOKEN` (and `$PLAIT_DAEMON_CLIENT_CERT`/`_KEY` for mutual TLS).

This module holds the commands only; what they show is built elsewhere: the tables in
`daemon_views` (laid out by `daemon_tables` for the terminal's width), `--json` documents with
`daemon_json`, the bottleneck picture in `daemon_pictures`, the RPC plumbing in `daemon_client`.
A host that does not answer is printed as a line under the tables and makes the command exit 1.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import grpc
import typer
from rich.markup import escape
from rich.text import Text

from plait.daemon import json_documents as daemon_json
from plait.daemon.address import DEFAULT_DAEMON_ADDRESS
from plait.daemon.config import (
    DEFAULT_HANG_TIMEOUT_SECONDS,
    DEFAULT_INGEST_CAPACITY,
    DEFAULT_METRICS_WINDOW_STEPS,
    DEFAULT_STALE_CEILING_SECONDS,
    DEFAULT_STALE_FLOOR_SECONDS,
    DEFAULT_STALE_STEP_MULTIPLE,
    DEFAULT_STRAGGLER_THRESHOLD,
    DEFAULT_WINDOW_SPANS,
    DEFAULT_WINDOW_STEPS,
    MAX_MESSAGE_BYTES,
)
from plait.daemon.control_records import DEFAULT_MAX_CAPTURES, DEFAULT_MAX_RANK_BYTES
from plait.daemon.job_reports import (
    BottleneckAnswers,
    JobSummary,
    aggregate_jobs,
    bottleneck_document,
    bottleneck_report,
    expert_rows,
    top_document,
)
from plait.daemon.report_messages import hang_from_message
from plait.daemon.worlds import marked_superseded, superseded_jobs
from plait.proto.plait.v1 import daemon_pb2
from plait.tools.daemon_client import (
    RPC_TIMEOUT_SECONDS,
    Hosts,
    Json,
    call_all,
    error_text,
    open_stub,
)
from plait.tools.daemon_targets import (
    DEFAULT_DEADLINE_SECONDS,
    Coverage,
    Deadline,
    HostsFile,
    Targets,
)
from plait.tools.daemon_views import (
    BottleneckView,
    DaemonRow,
    StatusView,
    TopView,
    render_hangs,
    render_top,
)
from plait.training.output import make_console, print_error

if TYPE_CHECKING:
    from plait.daemon.hangs import Hang
    from plait.proto.plait.v1 import control_pb2

__all__ = ["JobSummary", "aggregate_jobs", "app", "render_hangs", "render_top"]

app = typer.Typer(help="The node daemon and the commands that query it.")
console = make_console()


HANG_STACKS_TIMEOUT_SECONDS = 5.0  # a hung job's ranks answer from their exporter thread

ShowAll = Annotated[
    bool, typer.Option("--all", help="also finished jobs and ranks of earlier worlds")
]


def _emit_json(command: str, document: dict) -> None:
    # Plain stdout, not the rich console: rich would wrap and colour what a script parses.
    typer.echo(daemon_json.dumps(command, document))


# --------------------------------------------------------------------------------------------
# plait daemon
# --------------------------------------------------------------------------------------------


@app.command()
def daemon(
    bind: Annotated[
        str, typer.Option("--bind", help="address to listen on (loopback by default)")
    ] = DEFAULT_DAEMON_ADDRESS,
    window_steps: Annotated[
        int, typer.Option(help="steps kept per rank", min=1)
    ] = DEFAULT_WINDOW_STEPS,
    window_spans: Annotated[
        int, typer.Option(help="spans kept per rank", min=1)
    ] = DEFAULT_WINDOW_SPANS,
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
    max_message_mb: Annotated[
        float, typer.Option(help="largest request accepted", min=0.1)
    ] = MAX_MESSAGE_BYTES // 2**20,
    ingest_capacity: Annotated[
        int, typer.Option(help="spans + metric points stored at once before dropping", min=1)
    ] = DEFAULT_INGEST_CAPACITY,
    ingest_workers: Annotated[
        int,
        typer.Option(
            help="processes decoding large trace requests, one core each (0: the daemon's own)",
            min=0,
        ),
    ] = 0,
    max_streams: Annotated[
        int | None, typer.Option(help="concurrent streams/trace captures (default 3/4 of workers)")
    ] = None,
    hang_timeout: Annotated[
        float, typer.Option(help="seconds a partly entered collective may wait", min=0.1)
    ] = DEFAULT_HANG_TIMEOUT_SECONDS,
    straggler_threshold: Annotated[
        float, typer.Option(help="flag ranks this much slower than the median", min=0.0)
    ] = DEFAULT_STRAGGLER_THRESHOLD,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(help="forward upstream over OTLP/gRPC (default $OTEL_EXPORTER_OTLP_ENDPOINT)"),
    ] = None,
    prometheus: Annotated[
        str | None, typer.Option(help="serve Prometheus /metrics on host:port, e.g. 127.0.0.1:9464")
    ] = None,
    web: Annotated[
        str | None,
        typer.Option(
            help="serve the live web page on host:port, e.g. 127.0.0.1:8080 (TLS and token "
            "as the daemon's)"
        ),
    ] = None,
    calibrate: Annotated[
        bool,
        typer.Option(help="measure this host's CPU peak FLOP/s at start unless it is cached"),
    ] = True,
    stale_floor: Annotated[
        float, typer.Option(help="seconds of silence after which any rank is stale", min=0.1)
    ] = DEFAULT_STALE_FLOOR_SECONDS,
    stale_steps: Annotated[
        float, typer.Option(help="a rank is stale after this many of its median steps", min=0)
    ] = DEFAULT_STALE_STEP_MULTIPLE,
    stale_ceiling: Annotated[
        float, typer.Option(help="seconds of silence after which a rank is always stale", min=0.1)
    ] = DEFAULT_STALE_CEILING_SECONDS,
    max_capture_mb: Annotated[
        float, typer.Option(help="largest profile or memory capture a rank may send", min=1)
    ] = DEFAULT_MAX_RANK_BYTES // 2**20,
    max_captures: Annotated[
        int, typer.Option(help="profiles and memory captures in progress at once", min=1)
    ] = DEFAULT_MAX_CAPTURES,
    lighthouse: Annotated[
        str | None,
        typer.Option(
            help="host torchft's lighthouse for fault-tolerant replica groups on host:port, e.g. "
            "127.0.0.1:29510 (loopback unless --insecure: it has no TLS or token)"
        ),
    ] = None,
    lighthouse_min_groups: Annotated[
        int, typer.Option(help="fewest replica groups a quorum forms with", min=1)
    ] = 1,
    lighthouse_join_timeout: Annotated[
        float, typer.Option(help="seconds a quorum waits for a live group to ask", min=0.1)
    ] = 60.0,
    lighthouse_heartbeat_timeout: Annotated[
        float, typer.Option(help="seconds of silence before a group is left out", min=0.1)
    ] = 5.0,
) -> None:
    """Run the node daemon (OTLP receiver, plait.v1, health) until SIGTERM or Ctrl-C."""
    import os

    from plait.daemon.config import DaemonConfig
    from plait.daemon.control_records import ControlLimits
    from plait.daemon.lighthouse import LighthouseSettings
    from plait.daemon.security import SecurityConfig, SecurityError
    from plait.daemon.server import DaemonServer, serve

    if otlp_endpoint is None and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        otlp_endpoint = ""  # the exporter reads the standard variables
    try:
        config = DaemonConfig(
            bind=bind,
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
            ingest_workers=ingest_workers,
            max_streams=max_streams,
            hang_timeout=hang_timeout,
            straggler_threshold=straggler_threshold,
            otlp_endpoint=otlp_endpoint,
            prometheus=prometheus,
            web=web,
            stale_floor=stale_floor,
            stale_step_multiple=stale_steps,
            stale_ceiling=stale_ceiling,
            control=ControlLimits(
                max_rank_bytes=int(max_capture_mb * 2**20),
                max_request_bytes=max(int(max_capture_mb * 2**20), 256 * 2**20),
                max_captures=max_captures,
            ),
            lighthouse=(
                LighthouseSettings(
                    bind=lighthouse,
                    min_replicas=lighthouse_min_groups,
                    join_timeout_seconds=lighthouse_join_timeout,
                    heartbeat_timeout_seconds=lighthouse_heartbeat_timeout,
                    insecure=insecure,
                )
                if lighthouse is not None
                else None
            ),
        )
        server = DaemonServer(config=config)
    except (OSError, RuntimeError, SecurityError, ValueError) as exc:
        print_error(console, exc)
        raise typer.Exit(2) from None
    if calibrate:
        # Before any rank starts, so ranks of this host read the cache instead of measuring.
        from plait.tools.calibrate_commands import report_calibration

        report_calibration(console)
    address = server.address
    console.print(
        f"plait daemon listening on [bold]{escape(address)}[/bold] "
        f"(ranks export with telemetry.daemon = {escape(repr(address))} or PLAIT_DAEMON); "
        f"{escape(server.nvml.status)}",
        highlight=False,
    )
    if server.web is not None:
        console.print(f"live web page on [bold]{escape(server.web.url)}[/bold]", highlight=False)
    if server.lighthouse is not None:
        lighthouse_address = server.lighthouse.address
        console.print(
            f"lighthouse on [bold]{escape(lighthouse_address)}[/bold] (replica groups set "
            f"fault_tolerance.lighthouse = {escape(repr(lighthouse_address))})",
            highlight=False,
        )
    serve(server, grace=grace)
    console.print("plait daemon stopped")


# --------------------------------------------------------------------------------------------
# plait status
# --------------------------------------------------------------------------------------------


@app.command()
def status(
    hosts: Hosts = None,
    job: Annotated[str, typer.Option(help="job id: every daemon of the job answers")] = "",
    hosts_file: HostsFile = None,
    deadline: Deadline = DEFAULT_DEADLINE_SECONDS,
    as_json: Json = False,
    show_all: ShowAll = False,
) -> None:
    """Show each daemon's state, its jobs (state, worlds, restarts) and the ranks reporting."""
    targets = Targets.resolve(hosts, job, hosts_file, deadline)
    results, coverage = targets.ask(
        [
            ("Daemon/Status", daemon_pb2.StatusRequest()),
            ("Daemon/ListRanks", daemon_pb2.ListRanksRequest(job_id=job)),
            (
                "Daemon/GetMetrics",
                daemon_pb2.GetMetricsRequest(job_id=job, include_finished=show_all),
            ),
        ]
    )
    daemons, ranks, metrics, errors = [], [], [], []
    answered = {h: r for h, r in results.items() if not isinstance(r, grpc.RpcError)}
    # Jobs whose ranks on a host an elastic shrink left behind: superseded by another host's.
    superseded = superseded_jobs({host: result[2] for host, result in answered.items()})
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            errors.append((host, error_text(result)))
            continue
        state, listing, figures = result
        daemons.append(DaemonRow(host, state))
        listed = [
            marked_superseded(r) if r.job_id in superseded[host] else r for r in listing.ranks
        ]
        # Finished jobs and earlier worlds' ranks only with --all (or the job asked for).
        ranks.extend(
            r
            for r in listed
            if show_all
            or job
            or (r.status != "superseded" and state.job_states.get(r.job_id) != "finished")
        )
        metrics.append(figures)
    hangs = [hang_from_message(h) for d in daemons for h in d.state.hangs]
    view = StatusView(
        daemons=daemons,
        ranks=ranks,
        hangs=hangs,
        errors=errors,
        jobs=aggregate_jobs(metrics),
        experts=expert_rows(metrics),
        hang_stacks=hang_stacks(targets, hangs),
        rank_places=rank_places(results, coverage),
    )
    if as_json:
        _emit_json("status", {**status_document(view), **coverage_document(coverage)})
    else:
        console.print(view.render(console.width))
        print_coverage(coverage)
    if errors:
        raise typer.Exit(1)


def rank_places(
    results: Mapping[str, object], coverage: Coverage | None
) -> dict[tuple[str, int], str]:
    """(job, rank) -> "node1 (B:7461)": the node whose daemon lists the rank, for a job asked
    as a whole (empty otherwise: the host column says it)."""
    if coverage is None:
        return {}
    places = {}
    for label, result in results.items():
        if isinstance(result, grpc.RpcError):
            continue
        listing = result[1]  # type: ignore[index]
        node = coverage.nodes.get(label, -1)
        where = f"node{node} ({label})" if node >= 0 else label
        for rank in listing.ranks:
            places[(rank.job_id, rank.rank)] = where
    return places


def coverage_document(coverage: Coverage | None) -> dict:
    """The `daemons` key of a job-wide command's JSON: asked, answered, the missing ones."""
    return {"job_daemons": coverage.document()} if coverage is not None else {}


def print_coverage(coverage: Coverage | None) -> None:
    if coverage is not None:
        style = "yellow" if coverage.missing else "dim"
        console.print(Text(coverage.line(), style=style))


def hang_stacks(targets: Targets, hangs: list[Hang]) -> list[control_pb2.RankStacks]:
    """Where the ranks of each hung collective are: every rank of its group, the ones stuck in
    it and the ones that never came, asked for their stacks through the control channel."""
    from plait.daemon.hangs import merge_hangs

    # (job, replica group): a fault-tolerant job's hang is in one group's world, whose ranks
    # are asked, not the same rank numbers of the other groups.
    wanted: dict[tuple[str, int], set[int]] = {}
    for hang in merge_hangs(hangs):
        wanted.setdefault((hang.job_id, hang.replica_group), set()).update(hang.group_ranks)
    if not wanted:
        return []  # nothing is hung: the control channel's client is not even imported
    from plait.tools.profile_commands import fetch_stacks

    found = []
    for (job_id, replica_group), ranks in sorted(wanted.items()):
        stacks, _, _ = fetch_stacks(
            targets,
            job_id,
            sorted(ranks),
            HANG_STACKS_TIMEOUT_SECONDS,
            replica_group if replica_group >= 0 else None,
        )
        found.extend(stacks)
    return found


def status_document(view: StatusView) -> dict:
    from dataclasses import asdict

    from plait.daemon.hangs import merge_hangs
    from plait.tools.replica_group_views import (
        fault_tolerance_document,
        lighthouses,
        merge_fault_tolerant_jobs,
    )

    return {
        "daemons": [
            {"host": d.host, "error": None, "status": daemon_json.message_dict(d.state)}
            for d in view.daemons
        ]
        + [{"host": host, "error": error, "status": None} for host, error in view.errors],
        "ranks": [daemon_json.message_dict(r) for r in view.ranks],
        "hangs": [asdict(h) for h in merge_hangs(view.hangs)],
        "jobs": [{**daemon_json.dataclass_dict(j), "mfu": j.mfu} for j in view.jobs],
        "expert_load": [
            {"job_id": e.job_id, **daemon_json.message_dict(e.load)} for e in view.experts
        ],
        "hang_stacks": [daemon_json.message_dict(s) for s in view.hang_stacks],
        "rank_places": [
            {"job_id": job, "rank": rank, "where": where}
            for (job, rank), where in sorted(view.rank_places.items())
        ],
        **fault_tolerance_document(
            merge_fault_tolerant_jobs([d.state for d in view.daemons]),
            lighthouses([(d.host, d.state) for d in view.daemons]),
        ),
    }


# --------------------------------------------------------------------------------------------
# plait top
# --------------------------------------------------------------------------------------------


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
            channel, stub = open_stub(self.host)
            try:
                self._call = stub.StreamMetrics(self.request)
                for response in self._call:
                    self.latest = response
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    self.latest = error_text(exc)
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
    job: Annotated[
        str, typer.Option(help="job id: every daemon of the job answers (default: every job)")
    ] = "",
    hosts_file: HostsFile = None,
    deadline: Deadline = DEFAULT_DEADLINE_SECONDS,
    interval: Annotated[float, typer.Option(help="seconds between refreshes", min=0.1)] = 1.0,
    window_steps: Annotated[
        int, typer.Option(help="steps averaged per figure", min=0)
    ] = DEFAULT_METRICS_WINDOW_STEPS,
    once: Annotated[bool, typer.Option("--once", help="print one snapshot and exit")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one snapshot as JSON and exit (implies --once)")
    ] = False,
    show_all: ShowAll = False,
) -> None:
    """Live per-rank table: step, tokens/s, MFU, step time, communication share, memory."""
    targets = Targets.resolve(hosts, job, hosts_file, deadline)
    request = daemon_pb2.GetMetricsRequest(
        job_id=job, window_steps=window_steps, include_finished=show_all
    )
    if once or as_json:
        latest, coverage = latest_metrics(targets, request)
        view = TopView.from_latest(latest, show_superseded=show_all)
        if as_json:
            _emit_json("top", {**top_document(view), **coverage_document(coverage)})
        else:
            console.print(view.render(console.width))
            print_coverage(coverage)
        if view.errors:
            raise typer.Exit(1)
        return
    from rich.live import Live  # only the live screen needs it: --once and --json print once

    if targets.job_wide:
        _top_job(targets, request, interval, show_all)
        return
    stream = daemon_pb2.StreamMetricsRequest(
        job_id=job, window_steps=window_steps, interval_seconds=interval, include_finished=show_all
    )
    followers = [_Follower(host, stream) for host in targets.hosts]
    try:
        with Live(console=console, refresh_per_second=max(1.0, 1.0 / interval)) as live:
            while True:
                # The width is read on every refresh: the terminal may be resized under it.
                latest = {f.host: f.latest for f in followers}
                live.update(render_top(latest, console.width, show_superseded=show_all))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        for follower in followers:
            follower.stop()


def latest_metrics(
    targets: Targets, request: daemon_pb2.GetMetricsRequest
) -> tuple[dict[str, daemon_pb2.GetMetricsResponse | str], Coverage | None]:
    """Every daemon's metrics now (an error's text for one that gave none)."""
    results, coverage = targets.ask([("Daemon/GetMetrics", request)])
    latest = {
        h: error_text(r) if isinstance(r, grpc.RpcError) else r[0] for h, r in results.items()
    }
    return latest, coverage


def _top_job(
    targets: Targets, request: daemon_pb2.GetMetricsRequest, interval: float, show_all: bool
) -> None:
    """The live screen of a whole job: the job's daemons asked once per refresh."""
    from rich.console import Group
    from rich.live import Live

    try:
        with Live(console=console, refresh_per_second=max(1.0, 1.0 / interval)) as live:
            while True:
                latest, coverage = latest_metrics(targets, request)
                table = render_top(latest, console.width, show_superseded=show_all)
                line = Text(coverage.line(), style="dim") if coverage is not None else Text("")
                live.update(Group(table, line))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


# --------------------------------------------------------------------------------------------
# plait bottleneck
# --------------------------------------------------------------------------------------------


@app.command()
def bottleneck(
    hosts: Hosts = None,
    job: Annotated[
        str, typer.Option(help="job id: every daemon of the job answers (default: every job)")
    ] = "",
    hosts_file: HostsFile = None,
    deadline: Deadline = DEFAULT_DEADLINE_SECONDS,
    window_steps: Annotated[
        int, typer.Option(help="steps averaged per rank", min=0)
    ] = DEFAULT_METRICS_WINDOW_STEPS,
    threshold: Annotated[
        float, typer.Option(help="flag ranks this much slower than the median", min=0.0)
    ] = DEFAULT_STRAGGLER_THRESHOLD,
    png: Annotated[Path | None, typer.Option("--png", help="write a stacked bar chart")] = None,
    as_json: Json = False,
    show_all: ShowAll = False,
) -> None:
    """Per-rank breakdown of step time (compute, exposed comm, data, bubble, optimizer, host)."""
    request = daemon_pb2.GetBottleneckRequest(
        job_id=job,
        window_steps=window_steps,
        straggler_threshold=threshold,
        include_finished=show_all,
    )
    # The rank listing tells the advice each job's device and mesh; the metrics give the
    # picture's titles their MFU.
    results, coverage = Targets.resolve(hosts, job, hosts_file, deadline).ask(
        [
            ("Daemon/GetBottleneck", request),
            ("Daemon/ListRanks", daemon_pb2.ListRanksRequest(job_id=job)),
            (
                "Daemon/GetMetrics",
                daemon_pb2.GetMetricsRequest(
                    job_id=job, window_steps=window_steps, include_finished=show_all
                ),
            ),
        ]
    )
    view, metrics = bottleneck_view(results, threshold)  # type: ignore[arg-type]
    ranks = view.ranks
    if png is not None and ranks:
        # Imported here: only a command asked for a picture needs the picture's module.
        from plait.tools.daemon_pictures import JobFigures, write_bottleneck_png

        summaries = {
            j.job_id: JobFigures(
                mfu=j.mfu if j.peak_flops > 0 else None, step_seconds=j.step_seconds
            )
            for j in aggregate_jobs(metrics)
        }
        write_bottleneck_png(ranks, png, summaries)
    if as_json:
        _emit_json(
            "bottleneck",
            {**bottleneck_document(view, png if ranks else None), **coverage_document(coverage)},
        )
    else:
        console.print(view.render(console.width))
        print_coverage(coverage)
        if png is not None and ranks:
            console.print(f"wrote {png}", highlight=False)
    if view.errors:
        raise typer.Exit(1)


def bottleneck_view(
    results: Mapping[str, BottleneckAnswers | grpc.RpcError], threshold: float
) -> tuple[BottleneckView, list[daemon_pb2.GetMetricsResponse]]:
    """`plait bottleneck`'s report of every host's answers, drawn for the terminal."""
    return bottleneck_report(results, threshold, BottleneckView)


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
    hosts_file: HostsFile = None,
) -> None:
    """Capture the ranks' spans as a Chrome trace (open it in https://ui.perfetto.dev)."""
    from plait.daemon.chrome_trace import merge_traces

    targets = Targets.resolve(hosts, job, hosts_file).addresses()
    if seconds > 0:
        console.print(f"capturing {seconds:g}s of spans from {', '.join(targets)} …", markup=False)
    request = daemon_pb2.CaptureTraceRequest(seconds=seconds, job_id=job, ranks=ranks or [])
    results = call_all(
        targets, lambda stub: stub.CaptureTrace(request, timeout=seconds + RPC_TIMEOUT_SECONDS)
    )
    documents, span_count, failed = [], 0, False
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            console.print(Text.assemble((f"{host}: {error_text(result)}", "red")))
            failed = True
            continue
        documents.append(json.loads(result.chrome_trace_json))  # type: ignore[attr-defined]
        span_count += result.span_count  # type: ignore[attr-defined]
    merged = merge_traces(documents)
    output.write_text(json.dumps(merged))
    console.print(
        f"wrote {span_count} spans from {_traced_ranks(merged)} to {output} "
        "(open in https://ui.perfetto.dev)",
        highlight=False,
        markup=False,
    )
    if failed:
        raise typer.Exit(1)


def _traced_ranks(trace: dict) -> str:
    """ "ranks [0, 1]", or per job when the trace holds several ("job a ranks [0, 1], …")."""
    traced = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    processes = trace["otherData"].get("processes", {})
    by_job: dict[str, list[int]] = {}
    for pid in sorted(traced):
        process = processes.get(str(pid), {"job_id": "", "rank": pid})
        by_job.setdefault(process["job_id"], []).append(process["rank"])
    if len(by_job) <= 1:
        return f"ranks {next(iter(by_job.values()), [])}"
    return ", ".join(f"job {job_id} ranks {ranks}" for job_id, ranks in sorted(by_job.items()))
