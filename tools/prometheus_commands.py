"""`plait prometheus-targets` and `plait prometheus-rules`: one Prometheus for a whole job.

History rides on Prometheus, not on plait: each daemon serves `/metrics` (`plait daemon
--prometheus HOST:PORT`) with job, rank and host labels, and one Prometheus scrapes them all.
Nobody should type a thousand targets: this command asks the local daemon for the job's
daemons (the directory the job's ranks reported, `plait.daemon.job_directory`), asks each for
its `/metrics` address, and writes a `file_sd_configs` file Prometheus re-reads by itself::

    plait prometheus-targets --job llama-70b -o /etc/prometheus/targets/llama-70b.json

Each target carries the job id and the node index as labels. A daemon serving no `/metrics`
or not answering is named on stderr and left out, and the command exits 1.

`plait prometheus-rules` writes the recording rules that add the daemons' shares up into job
figures (`plait.daemon.prometheus_rules`): tokens/s, MFU and each rank's straggler score.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import grpc
import typer

from plait.proto.plait.v1 import daemon_pb2
from plait.tools.daemon_client import Hosts
from plait.tools.daemon_targets import DEFAULT_DEADLINE_SECONDS, Deadline, HostsFile, Targets
from plait.training.output import make_console, print_error

app = typer.Typer(help="Prometheus service discovery for a job's daemons.")
console = make_console(stderr=True)

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def scrape_address(metrics_address: str, daemon_address: str) -> str:
    """The `/metrics` address as Prometheus reaches it: a wildcard bind is served on the
    daemon's own address's host."""
    host, _, port = metrics_address.rpartition(":")
    if host in WILDCARD_HOSTS:
        return f"{daemon_address.rpartition(':')[0]}:{port}"
    return metrics_address


@app.command("prometheus-targets")
def prometheus_targets(
    job: Annotated[str, typer.Option("--job", help="job id")],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="file_sd JSON to write (default: stdout)")
    ] = None,
    hosts: Hosts = None,
    hosts_file: HostsFile = None,
    deadline: Deadline = DEFAULT_DEADLINE_SECONDS,
) -> None:
    """Write a Prometheus file_sd target list of the job's daemons (their /metrics)."""
    targets = Targets.resolve(hosts, job, hosts_file, deadline)
    results, coverage = targets.ask([("Daemon/Status", daemon_pb2.StatusRequest())])
    groups, failed = [], False
    nodes = coverage.nodes if coverage is not None else {}
    for address, result in sorted(results.items()):
        if isinstance(result, grpc.RpcError):
            print_error(console, f"{address}: {result.details()}")
            failed = True
            continue
        (status,) = result
        if not status.prometheus_address:
            print_error(console, f"{address}: serves no /metrics (plait daemon --prometheus)")
            failed = True
            continue
        labels = {"plait_job_id": job, "host_name": status.hostname}
        if nodes.get(address, -1) >= 0:
            labels["plait_node"] = str(nodes[address])
        groups.append(
            {"targets": [scrape_address(status.prometheus_address, address)], "labels": labels}
        )
    text = json.dumps(groups, indent=2) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        console.print(f"wrote {len(groups)} targets to {output}", highlight=False, markup=False)
    if coverage is not None and coverage.missing:
        console.print(coverage.line(), highlight=False, markup=False)
    if failed:
        raise typer.Exit(1)


@app.command("prometheus-rules")
def prometheus_rules(
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="rules file to write (default: stdout)")
    ] = None,
    interval: Annotated[
        float, typer.Option(help="seconds between evaluations of the rules", min=1)
    ] = 15.0,
) -> None:
    """Write Prometheus recording rules for job MFU, tokens/s and straggler scores."""
    from plait.daemon.prometheus_rules import recording_rules

    text = recording_rules(interval)
    if output is None:
        typer.echo(text, nl=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    console.print(f"wrote {output}", highlight=False, markup=False)
