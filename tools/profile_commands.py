"""Operator commands that reach into the ranks: `plait profile`, `plait stacks`, `plait memory`.

Each asks every daemon given with `--host` (one per node; default `$PLAIT_DAEMON`) through the
control channel (`plait.v1.Control`) and combines the answers:

* `profile` prepares the ranks' profilers on every daemon, picks one start step every rank of
  every host will still reach (from the step rates the daemons report), collects the traces,
  aligns the daemons' clocks (each measured against this machine's with a few `Clock` calls)
  and merges everything into one Perfetto trace; with several hosts the analysis is computed
  again over the merged trace, so waits across hosts count;
* `stacks` prints every thread's Python stack of every rank;
* `memory` writes each rank's files into a directory, named by rank.

A fault-tolerant job runs several replica groups under one job id, each with ranks 0..n-1: the
commands reach every group's ranks (`--replica-group G`: only group G's, `--ranks` then being
ranks within it), and name each rank with its group (`replica_group` in `--json`; absent for an
ordinary job, whose output is unchanged).

A rank that did not answer is named with its reason and the others are kept; a daemon that
does not know the job says so. The command exits 1 when any rank or host did not answer.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from rich.console import Console

from plait.daemon import json_documents as daemon_json
from plait.daemon.job_reports import profile_document
from plait.proto.plait.v1 import control_pb2
from plait.proto.plait.v1.control_pb2_grpc import ControlStub
from plait.tools.control_views import (
    error_lines,
    memory_columns,
    outcome_lines,
    render_analysis,
    render_stacks,
)
from plait.tools.daemon_client import (
    Hosts,
    Json,
    call_all,
    call_each,
    error_text,
)
from plait.tools.daemon_tables import build_table
from plait.tools.daemon_targets import HostsFile, Targets
from plait.training.output import print_error

app = typer.Typer(help="Profile, stack dumps and memory of a job's ranks, through the daemons.")
console = Console()

Job = Annotated[str, typer.Option("--job", help="job id (see `plait status`)")]
Ranks = Annotated[
    str | None, typer.Option("--ranks", help="only these ranks: 0,1,4 (default: every rank)")
]
ReplicaGroup = Annotated[
    int | None,
    typer.Option(
        "--replica-group",
        min=0,
        help="a fault-tolerant job: only this replica group's ranks (default: every group)",
    ),
]
CLOCK_SAMPLES = 5
# Planning a start step across daemons: each daemon's ranks poll within half a second, and
# the collect calls reach every daemon within the call latency.
MULTI_HOST_LOOKAHEAD_SECONDS = 3.0
EXTRA_RPC_SECONDS = 10.0


def _emit_json(command: str, document: dict) -> None:
    typer.echo(daemon_json.dumps(command, document))


def parse_ranks(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise typer.BadParameter(f"--ranks takes rank numbers like 0,1,4, got {text!r}") from None
    if any(r < 0 for r in ranks):
        raise typer.BadParameter(f"--ranks takes ranks >= 0, got {text!r}")
    return ranks


def _group_of(message: control_pb2.RankFile | control_pb2.ControlEndpoint) -> int | None:
    return message.replica_group if message.HasField("replica_group") else None


def _fail(message: str, code: int = 1) -> None:
    print_error(console, message)
    raise typer.Exit(code)


def _split(results: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    ok = {h: r for h, r in results.items() if not isinstance(r, grpc.RpcError)}
    errors = [(h, error_text(r)) for h, r in results.items() if isinstance(r, grpc.RpcError)]
    return ok, errors


def daemon_clock_offsets(hosts: Sequence[str]) -> dict[str, int]:
    """host -> its daemon's clock minus this machine's (ns), from the shortest of a few round
    trips (the same estimate the ranks make of their daemon)."""

    def measure(stub: ControlStub) -> int:
        best: tuple[int, int] | None = None
        for _ in range(CLOCK_SAMPLES):
            sent = time.time_ns()
            reply = stub.Clock(control_pb2.ClockRequest(), timeout=5.0)
            received = time.time_ns()
            sample = (received - sent, reply.unix_nano - (sent + received) // 2)
            best = sample if best is None else min(best, sample)
        assert best is not None
        return best[1]

    results = call_all(list(hosts), measure, stub=ControlStub)
    return {h: r for h, r in results.items() if isinstance(r, int)}


# --------------------------------------------------------------------------------------------
# plait profile
# --------------------------------------------------------------------------------------------


@app.command()
def profile(
    job: Job,
    output: Annotated[
        Path, typer.Option("-o", "--output", help="trace to write: .json or .json.gz")
    ],
    steps: Annotated[int, typer.Option(help="steps to record", min=0)] = 0,
    seconds: Annotated[float, typer.Option(help="or: seconds to record (as steps)", min=0)] = 0.0,
    ranks: Ranks = None,
    hosts: Hosts = None,
    with_stack: Annotated[bool, typer.Option("--with-stack", help="record Python stacks")] = False,
    record_shapes: Annotated[
        bool, typer.Option("--record-shapes", help="record operator input shapes")
    ] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the traces", min=1)] = 120.0,
    replica_group: ReplicaGroup = None,
    hosts_file: HostsFile = None,
    as_json: Json = False,
) -> None:
    """Record N steps of every rank with torch.profiler: one merged Perfetto trace, analysed."""
    if (steps > 0) == (seconds > 0):
        _fail("give --steps N or --seconds S (one of them)", 2)
    if not (output.name.endswith(".json") or output.name.endswith(".json.gz")):
        _fail(f"-o must name a .json or .json.gz file, got {output}", 2)
    wanted = parse_ranks(ranks)
    targets = Targets.resolve(hosts, job, hosts_file).addresses()
    if seconds and len(targets) > 1:
        steps, seconds = _steps_for_seconds(targets, job, wanted, seconds, replica_group), 0.0
    request = control_pb2.ProfileRequest(
        job_id=job,
        ranks=wanted,
        steps=steps,
        seconds=seconds,
        with_stack=with_stack,
        record_shapes=record_shapes,
        timeout_seconds=timeout,
        replica_group=replica_group,
    )
    if not as_json:
        what = f"{steps} steps" if steps else f"{seconds:g}s"
        console.print(
            f"preparing the profilers of job {job} ({what}) on {', '.join(targets)} …",
            markup=False,
        )
    prepared, errors = _split(
        call_all(
            targets,
            lambda stub: stub.PrepareProfile(request, timeout=timeout + EXTRA_RPC_SECONDS),
            stub=ControlStub,
        )
    )
    if not prepared:
        _report_failure(errors, as_json)
    # One daemon chooses (and may choose again after a miss); several need one step for all.
    start_step = _common_start(prepared) if len(prepared) > 1 else None

    def collect(request_id: str) -> Any:
        message = control_pb2.CollectProfileRequest(request_id=request_id, timeout_seconds=timeout)
        if start_step is not None:
            message.start_step = start_step
        return lambda stub: stub.CollectProfile(message, timeout=timeout + EXTRA_RPC_SECONDS)

    collected, collect_errors = _split(
        call_each({host: collect(p.request_id) for host, p in prepared.items()}, stub=ControlStub)
    )
    errors += collect_errors
    if not collected:
        _report_failure(errors, as_json)
    outcomes = [o for p in prepared.values() for o in p.outcomes]
    outcomes += [o for r in collected.values() for o in r.outcomes]
    document, analysis = merged_capture(collected)
    output.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, separators=(",", ":")).encode()
    output.write_bytes(gzip.compress(text) if output.name.endswith(".gz") else text)
    first = next(iter(collected.values()))
    if as_json:
        _emit_json(
            "profile",
            profile_document(
                output=str(output),
                response=first,
                analysis=analysis,
                outcomes=outcomes,
                errors=errors,
            ),
        )
    else:
        delivered = sorted({r.rank for r in analysis.ranks})
        last = first.start_step + max(first.steps, 1) - 1
        console.print(
            f"wrote {output}: ranks {delivered} of job {job}, steps {first.start_step}–{last} "
            "(open in https://ui.perfetto.dev)",
            highlight=False,
            markup=False,
        )
        console.print(render_analysis(analysis, console.width))
        for line in [*outcome_lines(outcomes), *error_lines(errors)]:
            console.print(line)
    if errors or any(o.state != "delivered" for o in outcomes):
        raise typer.Exit(1)


def _report_failure(errors: Sequence[tuple[str, str]], as_json: bool) -> None:
    """Nothing came back: say why, per host, and exit 1."""
    if as_json:
        _emit_json(
            "profile", {"file": None, "errors": [{"host": h, "error": e} for h, e in errors]}
        )
    else:
        for line in error_lines(errors):
            console.print(line)
    raise typer.Exit(1)


def _endpoints(prepared: dict[str, control_pb2.PrepareProfileResponse]) -> list:
    """Every host's ranks, their poll times moved to this machine's clock."""
    from plait.daemon.control_messages import endpoint_view

    now = time.time_ns()
    views = []
    for response in prepared.values():
        skew = now - response.daemon_unix_nano  # as if every daemon answered just now
        for endpoint in response.endpoints:
            moved = control_pb2.ControlEndpoint()
            moved.CopyFrom(endpoint)
            moved.last_poll_unix_nano = endpoint.last_poll_unix_nano + skew
            views.append(endpoint_view(moved))
    return views


def _common_start(prepared: dict[str, control_pb2.PrepareProfileResponse]) -> int:
    """The first step every rank on every host will still reach."""
    from plait.daemon.control_records import first_common_step

    return first_common_step(
        _endpoints(prepared), now_ns=time.time_ns(), lookahead_seconds=MULTI_HOST_LOOKAHEAD_SECONDS
    )


def _steps_for_seconds(
    hosts: list[str], job: str, ranks: list[int], seconds: float, replica_group: int | None
) -> int:
    """--seconds over several hosts: one step count for all, from every rank's pace."""
    from plait.daemon.control_messages import endpoint_view
    from plait.daemon.control_records import steps_for_seconds

    listed, _ = _split(
        call_all(
            hosts,
            lambda stub: stub.ListEndpoints(
                control_pb2.ListEndpointsRequest(job_id=job), timeout=10
            ),
            stub=ControlStub,
        )
    )
    views = [
        endpoint_view(e)
        for response in listed.values()
        for e in response.endpoints
        if e.polling
        and (not ranks or e.rank in ranks)
        and (replica_group is None or _group_of(e) == replica_group)
    ]
    steps = steps_for_seconds(seconds, views)
    if not steps:
        _fail(f"the ranks of job {job} have not reported a step rate yet: use --steps", 1)
    return steps


def merged_capture(
    collected: dict[str, control_pb2.ProfileResponse],
) -> tuple[dict, control_pb2.TraceAnalysis]:
    """One trace from every daemon's capture, and its analysis. One daemon: its trace and
    analysis as they came (on its clock). Several: each moved onto the first daemon's clock
    by the offsets measured here, merged, and analysed again as a whole."""
    from plait.daemon.chrome_trace import merge_traces

    documents = {h: json.loads(gzip.decompress(r.trace_json_gz)) for h, r in collected.items()}
    if len(documents) == 1:
        (host,) = documents
        return documents[host], collected[host].analysis
    from plait.daemon import trace_analysis
    from plait.daemon.control_messages import analysis_message

    offsets = daemon_clock_offsets(list(documents))
    reference = offsets.get(next(iter(documents)), 0)
    for host, document in documents.items():
        # A time on this daemon's clock, minus (its offset - the reference's), is on the
        # reference daemon's clock.
        other = document["otherData"]
        other["base_unix_nano"] = int(other["base_unix_nano"]) - (offsets.get(host, 0) - reference)
        for process in other.get("processes", {}).values():
            process["daemon"] = host
            process["daemon_clock_offset_ns"] = offsets.get(host, 0) - reference
    merged = merge_traces(documents.values())
    first = next(iter(collected.values()))
    merged["otherData"]["producer"] = "plait profile"
    merged["otherData"]["profile"] = {
        "start_step": first.start_step,
        "steps": first.steps,
        "requests": {host: r.request_id for host, r in collected.items()},
    }
    return merged, analysis_message(trace_analysis.analyze(merged))


# --------------------------------------------------------------------------------------------
# plait stacks
# --------------------------------------------------------------------------------------------


def fetch_stacks(
    targets: Targets,
    job: str,
    ranks: Sequence[int],
    timeout: float,
    replica_group: int | None = None,
) -> tuple[list[control_pb2.RankStacks], list[control_pb2.RankOutcome], list[tuple[str, str]]]:
    """Every addressed rank's stacks from every daemon (`replica_group`: only that group's);
    from every daemon of the job when `targets` is job-wide."""
    request = control_pb2.StacksRequest(
        job_id=job, ranks=ranks, timeout_seconds=timeout, replica_group=replica_group
    )
    results, _ = _for_job(targets, job, timeout).ask(
        [("Control/Stacks", request)], timeout=timeout + EXTRA_RPC_SECONDS
    )
    answered, errors = _split(results)
    stacks = [s for (response,) in answered.values() for s in response.ranks]
    outcomes = [o for (response,) in answered.values() for o in response.outcomes]
    return stacks, outcomes, errors


def _for_job(targets: Targets, job: str, wait: float) -> Targets:
    """`targets` asking about `job`, with a deadline past the ranks' own `wait`."""
    return replace(targets, job=job, deadline=max(targets.deadline, wait + EXTRA_RPC_SECONDS))


@app.command()
def stacks(
    job: Job,
    hosts: Hosts = None,
    ranks: Ranks = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the ranks", min=0.5)] = 10.0,
    replica_group: ReplicaGroup = None,
    hosts_file: HostsFile = None,
    as_json: Json = False,
) -> None:
    """Every thread's Python stack on every rank, taken while the training thread is stuck."""
    found, outcomes, errors = fetch_stacks(
        Targets.resolve(hosts, job, hosts_file), job, parse_ranks(ranks), timeout, replica_group
    )
    if as_json:
        _emit_json(
            "stacks",
            {
                "ranks": [daemon_json.message_dict(s) for s in found],
                "outcomes": [daemon_json.message_dict(o) for o in outcomes],
                "errors": [{"host": h, "error": e} for h, e in errors],
            },
        )
    else:
        console.print(render_stacks(found), highlight=False)
        for line in [*outcome_lines(outcomes), *error_lines(errors)]:
            console.print(line)
    if errors or any(o.state != "delivered" for o in outcomes):
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------
# plait memory
# --------------------------------------------------------------------------------------------


@app.command()
def memory(
    job: Job,
    output: Annotated[Path, typer.Option("-o", "--output", help="directory for the files")],
    hosts: Hosts = None,
    ranks: Ranks = None,
    wait: Annotated[
        float, typer.Option(help="seconds to wait for a step to meter", min=0.1)
    ] = 10.0,
    replica_group: ReplicaGroup = None,
    hosts_file: HostsFile = None,
    as_json: Json = False,
) -> None:
    """Each rank's memory: CUDA allocator snapshot, RSS, model state and activations, by rank."""
    request = control_pb2.MemoryRequest(
        job_id=job,
        ranks=parse_ranks(ranks),
        step_wait_seconds=wait,
        replica_group=replica_group,
    )
    targets = _for_job(Targets.resolve(hosts, job, hosts_file), job, wait + EXTRA_RPC_SECONDS)
    results, _ = targets.ask([("Control/Memory", request)], timeout=wait + 2 * EXTRA_RPC_SECONDS)
    answered, errors = _split(results)
    answered = {host: response for host, (response,) in answered.items()}
    from plait.daemon.control_records import rank_file_prefix
    from plait.daemon.telemetry_schema import NO_REPLICA_GROUP

    output.mkdir(parents=True, exist_ok=True)
    written, reports = [], []
    for response in answered.values():
        for file in response.files:
            group = _group_of(file)
            prefix = rank_file_prefix(NO_REPLICA_GROUP if group is None else group, file.rank)
            path = output / f"{prefix}.{file.name}"
            path.write_bytes(file.data)
            written.append(str(path))
            if file.name == "memory.json":
                report = json.loads(file.data)
                if group is not None:
                    report["replica_group"] = group
                reports.append((file.rank, report))
    outcomes = [o for response in answered.values() for o in response.outcomes]
    reports.sort(key=lambda r: (r[1].get("replica_group", -1), r[0]))
    if as_json:
        _emit_json(
            "memory",
            {
                "files": written,
                "ranks": [{"rank": rank, **report} for rank, report in reports],
                "outcomes": [daemon_json.message_dict(o) for o in outcomes],
                "errors": [{"host": h, "error": e} for h, e in errors],
            },
        )
    else:
        console.print(build_table("memory", memory_columns(), reports, console.width))
        console.print(f"wrote {len(written)} files to {output}", highlight=False, markup=False)
        for line in [*outcome_lines(outcomes), *error_lines(errors)]:
            console.print(line)
    if errors or any(o.state != "delivered" for o in outcomes):
        raise typer.Exit(1)
