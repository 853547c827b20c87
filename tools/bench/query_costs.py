"""What the daemon's queries cost with full windows, in one process, on one idle core.

    python tools/bench/query_costs.py [--ranks 8] [--steps 600] [--repeats 50]

A store is filled the way the receiver fills it: `--ranks` ranks of one job, each exporting
`--steps` steps of spans as plait's exporter encodes them (`daemon_load.encoded_rank_requests`:
a step, five phases and eleven collectives per step), received by the daemon's own trace
receiver (its reader, decoder and store). The daemon keeps its last 512 steps per rank, so
`--steps` above that leaves every window full. Then `GetMetrics`, `GetBottleneck` and `Status`
are answered `--repeats` times each by the servicer itself (no gRPC), and the median time of
each is printed: what one query holds the store's lock and a core for. `plait top` refreshes
once a second, and `StreamMetrics` answers every interval, so these add up on a node's daemon
under load (`daemon_load.py` measures that end to end).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from plait.daemon.host import HostCollector
from plait.daemon.otlp import TraceReceiver
from plait.daemon.otlp_requests import trace_request_parser
from plait.daemon.service import DaemonService
from plait.daemon.store import TelemetryStore
from plait.proto.plait.v1 import daemon_pb2
from plait.tools.bench.daemon_load import encoded_rank_requests


def filled_store(ranks: int, steps: int) -> TelemetryStore:
    """Every rank's requests through the daemon's own trace receiver and its deserializer."""
    store = TelemetryStore()
    receiver, parse = TraceReceiver(store), trace_request_parser()
    for rank in range(ranks):
        for data, _ in encoded_rank_requests(rank, ranks, steps=steps):
            receiver.Export(parse(data), None)  # type: ignore[arg-type]
    return store


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    call()  # the analysis caches per step are filled by the first query, as in a live daemon
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    store = filled_store(args.ranks, args.steps)
    service = DaemonService(
        store, HostCollector(lambda job_id: {}), bind_address="bench", stopping=threading.Event()
    )
    queries: dict[str, Callable[[], object]] = {
        "GetMetrics": lambda: service.GetMetrics(daemon_pb2.GetMetricsRequest(), None),  # type: ignore[arg-type]
        "GetBottleneck": lambda: service.GetBottleneck(daemon_pb2.GetBottleneckRequest(), None),  # type: ignore[arg-type]
        "Status": lambda: service.Status(daemon_pb2.StatusRequest(), None),  # type: ignore[arg-type]
    }
    table = Table(
        title=f"{args.ranks} ranks × {store.window_steps} steps kept, median of {args.repeats}"
    )
    table.add_column("query", justify="left")
    table.add_column("ms", justify="right")
    for name, call in queries.items():
        table.add_row(name, f"{median_seconds(call, args.repeats) * 1e3:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
