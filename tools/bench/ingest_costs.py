"""What one span costs each side of the daemon's ingest, on one idle core, in one process.

    python tools/bench/ingest_costs.py [--steps 400] [--rounds 3]

Requests are a rank's spans as plait's exporter encodes them (`daemon_load.encoded_rank_requests`:
steps, phases and collectives). Timed per span, for each round:

* the worker's part (`plait.daemon.ingest_pool`): reading the request (`otlp_wire`), decoding
  every span (`decoder`), writing the result as compact bytes (`ingest.encode_resources`);
* the daemon's part: reading those bytes back (`ingest.decode_wire`) and storing the spans.

The daemon alone reads, decodes into records and stores, and skips the bytes. With N workers
on N free cores a node stores about min(N / worker µs, 1 / daemon µs) spans per second, before
gRPC and queries; `daemon_load.py --ingest-workers N` measures it end to end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.daemon.decoder import StaticsCache
from plait.daemon.ingest import decode_resources, decode_wire, encode_resources
from plait.daemon.interpreter import collect_garbage_less_often
from plait.daemon.otlp_requests import trace_request_parser
from plait.daemon.store import TelemetryStore
from plait.tools.bench.daemon_load import encoded_rank_requests

STAGES = ("read", "decode", "encode", "read back", "store", "decode to records")
SIDES = {"read back": "daemon", "store": "daemon", "decode to records": "daemon alone"}


def one_round(
    requests: list[tuple[bytes, int]], parse: Any, statics: StaticsCache
) -> dict[str, float]:
    """Seconds per span of each stage into a fresh store, with the reader's and decoder's
    caches as a long-running worker keeps them."""
    store = TelemetryStore()
    seconds = dict.fromkeys(STAGES, 0.0)
    spans = 0
    for data, count in requests:
        t0 = time.perf_counter()
        request = parse(data)
        t1 = time.perf_counter()
        decoded = decode_resources(request.resources, statics, for_wire=True)
        t2 = time.perf_counter()
        blob = encode_resources(decoded)
        t3 = time.perf_counter()
        back = decode_wire(blob)
        t4 = time.perf_counter()
        for resource in back:
            if resource.identity is not None:
                store.add_spans(resource.identity, resource.records)
        t5 = time.perf_counter()
        decode_resources(request.resources, statics)  # what the daemon alone builds
        t6 = time.perf_counter()
        for stage, elapsed in zip(
            STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True
        ):
            seconds[stage] += elapsed
        spans += count
    return {stage: total / spans for stage, total in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps of one rank's spans")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    collect_garbage_less_often()  # as the daemon and its workers run
    requests = encoded_rank_requests(0, 2, steps=args.steps)
    parse, statics = trace_request_parser(), StaticsCache()
    one_round(requests, parse, statics)  # warm-up: the caches learn the spans' shapes
    rounds = [one_round(requests, parse, statics) for _ in range(args.rounds)]
    median = {stage: statistics.median(r[stage] for r in rounds) for stage in STAGES}

    table = Table(title=f"µs per span, median of {args.rounds} rounds of {args.steps} steps")
    table.add_column("stage", justify="left")
    table.add_column("side", justify="left")
    table.add_column("µs", justify="right")
    for stage in STAGES:
        table.add_row(stage, SIDES.get(stage, "worker"), f"{median[stage] * 1e6:.2f}")
    worker = median["read"] + median["decode"] + median["encode"]
    daemon = median["read back"] + median["store"]
    alone = median["read"] + median["decode to records"] + median["store"]
    console = Console()
    console.print(table)
    console.print(
        f"daemon alone: {alone * 1e6:.1f} µs per span = {1 / alone:,.0f} spans/s on one core\n"
        f"with workers: each worker {worker * 1e6:.1f} µs = {1 / worker:,.0f} spans/s per core; "
        f"the daemon {daemon * 1e6:.1f} µs = {1 / daemon:,.0f} spans/s"
    )


if __name__ == "__main__":
    main()
