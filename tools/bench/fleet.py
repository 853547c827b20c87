"""One job on many nodes, asked as one: `--job J` against N daemons of 8 ranks each.

    python tools/bench/fleet.py [--daemons 64 128 256] [--per-process 8] [--queries 30]
                                [--deadline 2] [--feed-interval 5]

N real `DaemonServer`s (several per worker process, so that a tenth of the fleet can be
stopped or killed as processes are) each hold 8 ranks of one job: every worker feeds its
daemons' ranks a new step over OTLP every `--feed-interval` seconds (one rank of a random node
1.3× slower than the others), and each daemon is told the job's node list with a poll, as each
node's first rank tells it. Then, through the CLI's own code path (`Targets.ask`, the merge
`plait top --json` prints):

* **discover**: `ListJobDaemons` on the local daemon (the first), median of 20;
* **top --job**: the job's metrics from every daemon and the merged table, `--queries` times:
  p50 and p99, of which the CLI's merge (decoding and the table, p50), and the largest node
  reply in bytes;
* **straggler**: `plait bottleneck --job`'s straggler ranking: whether the slowed rank is #1;
* **peer CPU**: the fleet's worker processes' CPU time per query, per daemon (one job query a
  second costs each daemon that fraction of a core);
* **CLI process**: `plait top --once --json --job J` run as its own process: wall time and peak
  RSS;
* **10 % down**: worker processes holding about a tenth of the daemons are stopped (SIGSTOP)
  and killed (SIGKILL); the next answer's time against the deadline, and whether it names
  exactly the missing nodes.

And one daemon's Prometheus `/metrics` scrape at 8 ranks (median of 20). Everything runs on
this machine's cores: the daemons, the feeding, and the query share them.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

RANKS_PER_NODE = 8
JOB = "fleet-bench"
STEP_NS = 100_000_000
SLOW = 1.3


# -- the worker processes (daemons and their ranks) ----------------------------------------------


def steps_request(
    rank: int, world: int, host: str, step: int, slow: bool, jitter: float = 0.0
) -> Any:
    """One step of `rank` as its exporter sends it: a step span and a forward phase span."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    from plait.daemon import telemetry_schema as schema

    def kv(key: str, value: object) -> common_pb2.KeyValue:
        if isinstance(value, str):
            return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))
        if isinstance(value, int):
            return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(int_value=value))
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(double_value=float(value)))

    duration = int(STEP_NS * (SLOW if slow else 1.0) * (1.0 + jitter))
    end = time.time_ns()
    start = end - duration
    trace_id = random.randbytes(16)
    step_attrs = [
        kv(schema.SPAN_STEP, step),
        kv(schema.SPAN_STEP_TOKENS, 8192 * world),
        kv(schema.SPAN_STEP_MODEL_FLOPS, 4e12 * world),
        kv(schema.SPAN_STEP_DATA_WAIT, 0.001),
        kv(schema.SPAN_STEP_LOSS, 2.0),
    ]
    step_span = trace_pb2.Span(
        trace_id=trace_id, span_id=random.randbytes(8), name=schema.STEP_SPAN_NAME,
        start_time_unix_nano=start, end_time_unix_nano=end, attributes=step_attrs,
    )  # fmt: skip
    forward = trace_pb2.Span(
        trace_id=trace_id, span_id=random.randbytes(8), parent_span_id=step_span.span_id,
        name=schema.PHASE_FORWARD, start_time_unix_nano=start,
        end_time_unix_nano=start + duration // 2,
        attributes=[kv(schema.SPAN_STEP, step), kv(schema.SPAN_PHASE, schema.PHASE_FORWARD)],
    )  # fmt: skip
    resource = [
        kv(schema.RESOURCE_JOB_ID, JOB),
        kv(schema.RESOURCE_RANK, rank),
        kv(schema.RESOURCE_WORLD_SIZE, world),
        kv(schema.RESOURCE_HOST_NAME, host),
        kv(schema.RESOURCE_PEAK_FLOPS, 1e15),
    ]
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource={"attributes": resource},
                scope_spans=[trace_pb2.ScopeSpans(spans=[step_span, forward])],
            )
        ]
    )


def _worker(count: int, conn: Connection) -> None:
    """Host `count` daemons; tell the parent their addresses; then, once told the job's node
    list, report it to each daemon and feed their ranks steps until killed."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from plait.daemon.config import DaemonConfig
    from plait.daemon.server import DaemonServer
    from plait.proto.plait.v1 import control_pb2, control_pb2_grpc

    config = DaemonConfig(bind="127.0.0.1:0", host_interval=3600.0, gpu_interval=3600.0)
    daemons = [DaemonServer(config=config).start() for _ in range(count)]
    conn.send([d.address for d in daemons])
    plan = conn.recv()  # {"nodes": [(address, host)], "first": node index, "slow": rank}
    world = len(plan["nodes"]) * RANKS_PER_NODE
    nodes = [
        control_pb2.JobNode(
            node=i, host=host, daemon=address,
            ranks=range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE),
        )
        for i, (address, host) in enumerate(plan["nodes"])
    ]  # fmt: skip
    channels = [grpc.insecure_channel(d.address) for d in daemons]
    exports = [trace_service_pb2_grpc.TraceServiceStub(c) for c in channels]
    for offset, channel in enumerate(channels):
        node = plan["first"] + offset
        control_pb2_grpc.ControlStub(channel).Poll(
            control_pb2.PollRequest(
                job_id=JOB, rank=node * RANKS_PER_NODE, world_size=world,
                host=plan["nodes"][node][1], pid=os.getpid(), job_nodes=nodes, self_node=node,
            ),
            timeout=30,
        )  # fmt: skip
    conn.send("ready")
    draw = random.Random(plan["first"])  # each worker's own step-to-step noise
    step = 0
    while True:
        for offset, export in enumerate(exports):
            node = plan["first"] + offset
            host = plan["nodes"][node][1]
            for local in range(RANKS_PER_NODE):
                rank = node * RANKS_PER_NODE + local
                jitter = draw.uniform(-plan["jitter"], plan["jitter"])
                request = steps_request(rank, world, host, step, rank == plan["slow"], jitter)
                export.Export(request, timeout=30)
        step += 1
        if conn.poll(plan["feed_interval"]):
            conn.recv()
            conn.send("fed")


@dataclass
class Fleet:
    processes: list[mp.process.BaseProcess]
    pipes: list[Connection]
    addresses: list[str]  # node i's daemon
    owner: list[int]  # node i -> its worker process
    slow_rank: int

    def stop(self) -> None:
        for process in self.processes:
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.join(timeout=10)


def start_fleet(
    daemons: int,
    per_process: int,
    feed_interval: float,
    seed: int,
    *,
    slowed: bool = True,
    jitter: float = 0.0,
) -> Fleet:
    """N daemons of 8 ranks each; one rank of a random node slowed 1.3× unless not `slowed`;
    every step's time varied by up to ±`jitter` (a fraction)."""
    from plait.core.host import host_name

    context = mp.get_context("spawn")
    processes, pipes, addresses, owner = [], [], [], []
    counts = [per_process] * (daemons // per_process) + (
        [daemons % per_process] if daemons % per_process else []
    )
    for index, count in enumerate(counts):
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(count, child), daemon=True)
        process.start()
        processes.append(process)
        pipes.append(parent)
        found = parent.recv()
        addresses += found
        owner += [index] * len(found)
    host = host_name()
    draw = random.Random(seed)
    slow_rank = draw.randrange(len(addresses) * RANKS_PER_NODE) if slowed else -1
    nodes = [(address, host) for address in addresses]
    first = 0
    for pipe, count in zip(pipes, counts, strict=True):
        pipe.send({"nodes": nodes, "first": first, "slow": slow_rank,
                   "feed_interval": feed_interval, "jitter": jitter})  # fmt: skip
        first += count
    for pipe in pipes:
        assert pipe.recv() == "ready"
    return Fleet(processes, pipes, addresses, owner, slow_rank)


def wait_fed(fleet: Fleet, rounds: int) -> None:
    """Until every worker has fed `rounds` more steps (the window fills with real steps)."""
    for _ in range(rounds):
        for pipe in fleet.pipes:
            pipe.send("tick")
        for pipe in fleet.pipes:
            assert pipe.recv() == "fed"


# -- the measurements -----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(fleet: Fleet, skip: set[int] = frozenset()) -> float:  # type: ignore[assignment]
    import psutil

    total = 0.0
    for index, process in enumerate(fleet.processes):
        if index in skip or process.pid is None:
            continue
        times = psutil.Process(process.pid).cpu_times()
        total += times.user + times.system
    return total


def measure(daemons: int, args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
    from plait.tools.daemon_commands import bottleneck_view, latest_metrics, top_document
    from plait.tools.daemon_targets import Targets
    from plait.tools.daemon_views import TopView

    fleet = start_fleet(daemons, args.per_process, args.feed_interval, args.seed + daemons)
    try:
        wait_fed(fleet, 3)
        local = fleet.addresses[0]
        out: dict[str, Any] = {"daemons": daemons, "ranks": daemons * RANKS_PER_NODE}

        with grpc.insecure_channel(local) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            timings = []
            for _ in range(20):
                started = time.perf_counter()
                listing = stub.ListJobDaemons(daemon_pb2.ListJobDaemonsRequest(job_id=JOB))
                timings.append(time.perf_counter() - started)
            assert len(listing.daemons) == daemons
            out["discover_ms"] = statistics.median(timings) * 1e3
            reply = stub.AskJob(
                daemon_pb2.AskJobRequest(
                    job_id=JOB, deadline_seconds=args.deadline,
                    questions=[daemon_pb2.JobQuestion(
                        method="Daemon/GetMetrics",
                        request=daemon_pb2.GetMetricsRequest(job_id=JOB).SerializeToString())],
                ),
                timeout=args.deadline + 5,
            )  # fmt: skip
            out["reply_bytes_max"] = max(len(a.responses[0]) for a in reply.answers if a.responses)

        targets = Targets((local,), job=JOB, via=local, deadline=args.deadline)
        request = daemon_pb2.GetMetricsRequest(job_id=JOB, window_steps=20)
        latencies, merges, answered = [], [], []
        cpu_before = cpu_seconds(fleet)
        for _ in range(args.queries):
            started = time.perf_counter()
            latest, coverage = latest_metrics(targets, request)
            asked = time.perf_counter()
            document = top_document(TopView.from_latest(latest))
            latencies.append(time.perf_counter() - started)
            merges.append(time.perf_counter() - asked)
            assert coverage is not None
            answered.append(coverage.answered)
        cpu_after = cpu_seconds(fleet)
        out["top_p50_ms"] = percentile(latencies, 0.5) * 1e3
        out["top_p99_ms"] = percentile(latencies, 0.99) * 1e3
        out["merge_p50_ms"] = percentile(merges, 0.5) * 1e3  # the CLI's own share
        out["answered_min"] = min(answered)
        out["ranks_shown"] = len(document["ranks"])
        # What answering costs the fleet: its CPU while queried (feeding included, so an upper
        # bound), per query and daemon: at one query a second, that fraction of a core.
        out["peer_cpu_per_query_ms"] = (cpu_after - cpu_before) / args.queries / daemons * 1e3

        bottleneck_questions = [
            ("Daemon/GetBottleneck", daemon_pb2.GetBottleneckRequest(
                job_id=JOB, window_steps=20, straggler_threshold=0.2)),
            ("Daemon/ListRanks", daemon_pb2.ListRanksRequest(job_id=JOB)),
            ("Daemon/GetMetrics", request),
        ]  # fmt: skip
        results, coverage = targets.ask(bottleneck_questions)
        view, _ = bottleneck_view(results, 0.2)  # type: ignore[arg-type]
        assert coverage is not None
        slow_node = fleet.slow_rank // RANKS_PER_NODE
        out["straggler_absent"] = any(m.node == slow_node for m in coverage.missing)
        # Ranked against the median of every rank of every node: the slowed rank first, and
        # the only one flagged (no false positive among the others).
        ranked = sorted(view.stragglers, key=lambda s: -max(s.step_score, s.compute_score))
        flagged = {s.rank for s in view.stragglers if s.flagged}
        out["straggler_found"] = bool(ranked) and ranked[0].rank == fleet.slow_rank
        out["straggler_only"] = flagged == {fleet.slow_rank}

        out["cli_seconds"], out["cli_rss_mb"] = cli_run(local, args.deadline)

        # About a tenth of the daemons down: half their processes stopped, half killed.
        victims = pick_victims(fleet, daemons // 10)
        for index, how in victims.items():
            os.kill(fleet.processes[index].pid, how)  # type: ignore[arg-type]
        expected = {n for n, owner in enumerate(fleet.owner) if owner in victims}
        started = time.perf_counter()
        results, coverage = targets.ask([("Daemon/GetMetrics", request)])
        out["down_seconds"] = time.perf_counter() - started
        assert coverage is not None
        out["down"] = len(expected)
        out["down_named_exactly"] = {m.node for m in coverage.missing} == expected
        out["deadline"] = args.deadline
        return out
    finally:
        fleet.stop()


def cli_run(local: str, deadline: float) -> tuple[float, float]:
    """`plait top --once --json --job J` as an operator runs it: its wall time, and its peak
    RSS (read by a parent of its own, whose only child it is)."""
    command = [sys.executable, "-m", "plait.tools.cli", "top", "--once", "--json", "--job", JOB,
               "--deadline", str(deadline)]  # fmt: skip
    measure_child = (
        "import resource, subprocess, sys, time\n"
        f"started = time.perf_counter()\n"
        f"done = subprocess.run({command!r}, capture_output=True)\n"
        "assert done.returncode == 0, done.stderr\n"
        "print(time.perf_counter() - started, "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    env = dict(os.environ, PLAIT_DAEMON=local)
    done = subprocess.run(
        [sys.executable, "-c", measure_child], capture_output=True, text=True, env=env,
        timeout=120, check=True,
    )  # fmt: skip
    seconds, peak_kb = done.stdout.split()
    return float(seconds), int(peak_kb) / 1024


def pick_victims(fleet: Fleet, wanted: int) -> dict[int, int]:
    """Worker processes (never the local daemon's) holding about `wanted` daemons: index ->
    the signal that takes them down, alternating stop and kill."""
    sizes: dict[int, int] = {}
    for owner in fleet.owner:
        sizes[owner] = sizes.get(owner, 0) + 1
    victims: dict[int, int] = {}
    taken = 0
    for index in sorted(sizes, reverse=True):
        if index == fleet.owner[0] or taken >= max(wanted, 1):
            continue
        victims[index] = signal.SIGSTOP if len(victims) % 2 == 0 else signal.SIGKILL
        taken += sizes[index]
    return victims


def scrape_ms() -> float:
    """One daemon's `/metrics` at 8 ranks: median of 20 scrapes."""
    import urllib.request

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from plait.daemon.config import DaemonConfig
    from plait.daemon.server import DaemonServer

    config = DaemonConfig(bind="127.0.0.1:0", prometheus="127.0.0.1:0", host_interval=3600.0)
    with DaemonServer(config=config) as daemon:
        with grpc.insecure_channel(daemon.address) as channel:
            export = trace_service_pb2_grpc.TraceServiceStub(channel)
            for step in range(20):
                for rank in range(RANKS_PER_NODE):
                    export.Export(steps_request(rank, RANKS_PER_NODE, "bench", step, False))
        assert daemon.prometheus is not None
        url = f"http://{daemon.prometheus.address}/metrics"
        timings = []
        for _ in range(20):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as reply:
                reply.read()
            timings.append(time.perf_counter() - started)
        return statistics.median(timings) * 1e3


def _straggler(r: dict[str, Any]) -> str:
    if r["straggler_absent"]:
        return "no answer"  # the slowed rank's daemon missed the deadline
    if not r["straggler_found"]:
        return "MISSED"
    return "#1" if r["straggler_only"] else "#1+false"


def clean_runs(runs: int, daemons: int, args: argparse.Namespace) -> list[int]:
    """Ranks flagged as stragglers in each of `runs` fresh fleets where no rank is slow and
    every step varies by up to ±5 %: each should be 0 (no false positive)."""
    from plait.proto.plait.v1 import daemon_pb2
    from plait.tools.daemon_commands import bottleneck_view
    from plait.tools.daemon_targets import Targets

    flagged = []
    for run in range(runs):
        fleet = start_fleet(
            daemons, args.per_process, args.feed_interval, args.seed + 1000 + run,
            slowed=False, jitter=0.05,
        )  # fmt: skip
        try:
            wait_fed(fleet, 5)
            local = fleet.addresses[0]
            targets = Targets((local,), job=JOB, via=local, deadline=10.0)
            questions = [
                ("Daemon/GetBottleneck", daemon_pb2.GetBottleneckRequest(
                    job_id=JOB, window_steps=20, straggler_threshold=0.2)),
                ("Daemon/ListRanks", daemon_pb2.ListRanksRequest(job_id=JOB)),
                ("Daemon/GetMetrics", daemon_pb2.GetMetricsRequest(job_id=JOB)),
            ]  # fmt: skip
            results, _ = targets.ask(questions)
            view, _ = bottleneck_view(results, 0.2)  # type: ignore[arg-type]
            flagged.append(sum(s.flagged for s in view.stragglers))
        finally:
            fleet.stop()
    return flagged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--per-process", type=int, default=8)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--feed-interval", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clean-runs", type=int, default=0,
        help="also N fresh fleets of --clean-daemons with no slow rank (±5 %% step noise): "
        "ranks falsely flagged as stragglers in each",
    )  # fmt: skip
    parser.add_argument("--clean-daemons", type=int, default=32)
    args = parser.parse_args()
    if args.clean_runs:
        flagged = clean_runs(args.clean_runs, args.clean_daemons, args)
        print(
            f"{args.clean_runs} clean runs of {args.clean_daemons} daemons "
            f"({args.clean_daemons * RANKS_PER_NODE} ranks, ±5 % step noise): "
            f"ranks falsely flagged per run {flagged}"
        )
    print(f"prometheus scrape at {RANKS_PER_NODE} ranks: {scrape_ms():.1f} ms (median of 20)")
    header = (
        f"{'daemons':>7} {'ranks':>6} {'discover':>9} {'top p50':>8} {'top p99':>8} "
        f"{'merge':>6} {'reply B':>8} {'peer cpu':>9} {'straggler':>9} {'cli s':>6} {'cli MB':>7} "
        f"{'down':>5} {'down s':>7} {'named':>6}"
    )
    print(header)
    for daemons in args.daemons:
        r = measure(daemons, args)
        print(
            f"{r['daemons']:>7} {r['ranks']:>6} {r['discover_ms']:>7.1f}ms "
            f"{r['top_p50_ms']:>6.0f}ms {r['top_p99_ms']:>6.0f}ms {r['merge_p50_ms']:>4.0f}ms "
            f"{r['reply_bytes_max']:>8} "
            f"{r['peer_cpu_per_query_ms']:>7.2f}ms {_straggler(r):>9} "
            f"{r['cli_seconds']:>6.2f} {r['cli_rss_mb']:>7.0f} {r['down']:>5} "
            f"{r['down_seconds']:>6.2f}s {'yes' if r['down_named_exactly'] else 'NO':>6}",
            flush=True,
        )
        if r["answered_min"] < daemons:
            print(f"  (only {r['answered_min']}/{daemons} daemons answered one of the queries)")


if __name__ == "__main__":
    main()
