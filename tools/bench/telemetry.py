"""Telemetry cost: step time with telemetry on vs off in the same run, and daemon ingest rate.

    python tools/bench/telemetry.py [--steps 60] [--block 1] [--ingest-seconds 5]

1. Step time. Two Gloo ranks each build one engine over a tiny Llama with telemetry exporting
   to a daemon in this process, and rotate blocks of steps (one step each by default) between
   three modes: telemetry on, off (its plugin unregistered, as `telemetry.enabled = false`
   leaves it) and off again (a control), so machine noise hits all alike. Reported: median
   wall time of `train_step` (hooks included) per mode, and the median over rounds of each
   round's ratio: on / off is the overhead, control / off what the same measure shows when
   nothing differs (its noise floor on a shared machine).
2. Hook cost. The telemetry `plait_communicate` wrapper and `plait_step_end`, timed directly
   in one process against a backend that does no communication.
3. Ingest. Batches of comm-like spans, encoded once, sent back to back over loopback to a
   daemon in a separate process: spans stored per second. The stock OTLP exporter's own rate
   (encoding included) is printed beside it, and the receiver's own rate in this process for
   the same request, read from its bytes and by walking protobuf messages.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import grpc
import torch
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console
from rich.table import Table

from plait.core.comm import Comm, CompletedWork, Group
from plait.core.config import load_config
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.core.step import JobInfo, PhaseSpan, StepReport
from plait.daemon.otlp import TraceReceiver
from plait.daemon.otlp_requests import TraceRequest, trace_request_parser
from plait.daemon.peak_flops import PeakFlops
from plait.daemon.server import DaemonServer
from plait.daemon.store import TelemetryStore
from plait.daemon.telemetry_resource import resource_attributes
from plait.plugins.telemetry import make_plugin
from plait.plugins.telemetry.comm_records import CommRecord
from plait.plugins.telemetry.plugin import comm_attributes
from plait.testing.distributed import run_distributed

VOCAB_SEQ = 16
BENCH_JOB = JobInfo(
    job_id="bench", rank=0, local_rank=0, world_size=2, host="bench",
    degrees={"dp": 2}, coordinates={"dp": 0}, device="cpu", device_name="cpu",
    compute_dtype="float32", model_name="none", num_params=0, flops_per_token=0.0,
    tokens_per_step=0,
)  # fmt: skip


class NoopBackend:
    """Answers every op at once, so the facade and its wrappers are all that is timed."""

    @hookimpl(trylast=True)
    def plait_communicate(self, request: CommRequest) -> CompletedWork:
        return CompletedWork()


def _report(step: int) -> StepReport:
    end = time.time_ns()
    start = end - 5_000_000
    phases = tuple(
        PhaseSpan(name=name, start_ns=start + i * 1_000_000, end_ns=start + (i + 1) * 1_000_000)
        for i, name in enumerate(("data", "forward", "backward", "sync_gradients", "optimizer"))
    )
    return StepReport(
        step=step, loss=1.0, tokens=1, step_seconds=0.005, data_wait_seconds=0.001,
        model_flops=1.0, lr=1e-3, start_ns=start, end_ns=end, spans=phases,
    )  # fmt: skip


def _engine(address: str | None, seed: int) -> Any:
    from plait.core.engine import Engine

    torch.manual_seed(seed)
    return Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": VOCAB_SEQ},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "seed": seed},
            "ddp": {"bucket_mb": 0.05},
            "telemetry": {
                "enabled": address is not None,
                "daemon": address or "",
                "job_id": "bench",
            },
        },
        plugins=Plugins.create(autoload=False),
    )


MODES = ("off", "on", "control")  # control: telemetry off again (A/A: the noise floor)


def step_time_rank(rank: int, world_size: int, address: str, steps: int, block: int) -> dict:
    """Rotate blocks of steps between telemetry on, off and off again, on ONE engine.

    One engine, its telemetry plugin registered for the "on" blocks and unregistered for the
    others (what `telemetry.enabled = false` does), so the modes share the model, buffers and
    process groups: two engines differ by a few percent from memory layout alone, more than
    the effect measured here.
    """
    engine = _engine(address, 0)
    manager = engine.plugins.manager
    plugin = manager.get_plugin("telemetry")
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(rank)

    def use(mode: str) -> None:
        registered = manager.has_plugin("telemetry")
        if mode == "on" and not registered:
            manager.register(plugin, name="telemetry")
        elif mode != "on" and registered:
            manager.unregister(name="telemetry")

    def step() -> float:
        tokens = torch.randint(0, vocab, (4, VOCAB_SEQ + 1), generator=generator)
        start = time.perf_counter()
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        return time.perf_counter() - start

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up outside the measurement
        use(mode)
        for _ in range(2):
            step()
    for i in range(steps // block):
        order = MODES[i % 3 :] + MODES[: i % 3]  # each mode first, second and third in turn
        for mode in order:
            use(mode)
            for _ in range(block):
                times[mode].append(step())
    use("on")
    engine.close()
    return times


def pair_ratios(times: dict[str, list[float]], mode: str) -> list[float]:
    """`mode`'s step time over the "off" step of the same round, one ratio per round."""
    return [a / b for a, b in zip(times[mode], times["off"], strict=True)]


def hook_cost(ops: int = 20_000) -> dict[str, float]:
    """Microseconds per comm op through the facade with and without the telemetry wrapper."""
    results: dict[str, float] = {}
    tensor = torch.zeros(1024)
    group = Group(name="dp", ranks=(0, 1))
    with DaemonServer("127.0.0.1:0", host_interval=5.0) as server:
        for mode in ("off", "on"):
            plugins = Plugins.create(autoload=False, builtins=(), extra=[("noop", NoopBackend())])
            plugin = make_plugin()
            if mode == "on":
                plugins.register(plugin, "telemetry")
                plugins.configure(load_config({"telemetry": {"daemon": server.address}}))
                plugins.job_start(BENCH_JOB)
            comm = Comm(plugins)
            plugins.step_start(0)
            start = time.perf_counter()
            for _ in range(ops):
                comm.all_reduce(tensor, group=group, purpose="grad_bucket")
            results[f"comm_op_{mode}_us"] = (time.perf_counter() - start) / ops * 1e6
            if mode == "on":
                # step_end hands the step and its ops to the exporter thread: time it
                plugin.records = plugin.records[:100]
                start = time.perf_counter()
                plugins.step_end(_report(0))
                results["step_end_100_ops_ms"] = (time.perf_counter() - start) * 1e3
                plugins.job_end()
    return results


def _serve_daemon(queue: Any, stop: Any) -> None:
    server = DaemonServer("127.0.0.1:0", host_interval=5.0).start()
    queue.put(server.address)
    stop.wait()
    queue.put(server.store.spans_received)
    server.stop(grace=1.0)


def ingest_rate(seconds: float, batch: int = 2048) -> dict[str, float]:
    """Spans per second a daemon in another process stores from the stock OTLP exporter."""
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=_serve_daemon, args=(queue, stop), daemon=True)
    process.start()
    address = queue.get(timeout=60)
    memory = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create(resource_attributes(BENCH_JOB, PeakFlops(1e12, "bench")))
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("bench")
    now = time.time_ns()
    for seq in range(batch):
        record = CommRecord(
            op="all_reduce", nbytes=4 << 20, dtype=torch.float32, group_name="dp",
            group_ranks=(0, 1), seq=seq, purpose="grad_bucket", peer=None, async_op=True,
            step=seq // 16, start_ns=now + seq * 1000, end_ns=now + seq * 1000 + 500,
        )  # fmt: skip
        span = tracer.start_span(
            "all_reduce", start_time=record.start_ns, attributes=comm_attributes(record)
        )
        span.end(end_time=record.end_ns)
    spans = memory.get_finished_spans()
    # The stock exporter's encoding runs in the rank's export thread; time it on its own.
    exporter = OTLPSpanExporter(endpoint=address, insecure=True, timeout=30)
    start = time.perf_counter()
    exporter.export(spans)
    exporter_seconds = time.perf_counter() - start
    exporter.shutdown()
    # Then the daemon alone: the same batch, encoded once, sent back to back.
    request = encode_spans(spans)
    channel = grpc.insecure_channel(address)
    stub = trace_service_pb2_grpc.TraceServiceStub(channel)
    sent, start = len(spans), time.perf_counter()
    while time.perf_counter() - start < seconds:
        stub.Export(request, timeout=30)
        sent += len(spans)
    elapsed = time.perf_counter() - start
    channel.close()
    stop.set()
    stored = queue.get(timeout=60)
    process.join(10)
    # The receiver alone, in this process (CPU time, best of five): the message walk it used to
    # do against the wire reader it does now, on the same request.
    raw = request.SerializeToString()
    paths = {
        "walk": lambda: TraceRequest.from_message(ExportTraceServiceRequest.FromString(raw)),
        "reader": lambda: trace_request_parser()(raw),
    }
    in_process = {}
    for label, parse in paths.items():
        best = 0.0
        for _ in range(5):
            receiver = TraceReceiver(TelemetryStore())
            began = time.process_time()
            receiver.Export(parse(), None)  # type: ignore[arg-type]
            best = max(best, len(spans) / max(time.process_time() - began, 1e-9))
        in_process[label] = best
    return {
        "walk_spans_per_second": in_process["walk"],
        "reader_spans_per_second": in_process["reader"],
        "spans_sent": sent,
        "spans_stored": stored,
        "spans_per_second": (sent - len(spans)) / elapsed,
        "exporter_spans_per_second": len(spans) / exporter_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per mode")
    parser.add_argument("--block", type=int, default=1, help="steps per alternating block")
    parser.add_argument("--ingest-seconds", type=float, default=5.0)
    parser.add_argument("--only-steps", action="store_true", help="step time only")
    args = parser.parse_args()
    console = Console()

    with DaemonServer("127.0.0.1:0", host_interval=1.0) as server:
        per_rank = run_distributed(
            step_time_rank, 2, server.address, args.steps, args.block, timeout=900
        )
        spans = server.store.spans_received
    table = Table(
        title="step time, 2 Gloo ranks, tiny Llama, one engine, telemetry toggled per step"
    )
    columns = ("rank", "median off", "median on", "median control")
    for column in (*columns, "on / off", "control / off", "rounds"):
        table.add_column(column, justify="right")
    ratios, controls = [], []
    for rank, times in enumerate(per_rank):
        median = {mode: statistics.median(values) for mode, values in times.items()}
        # Median of per-round ratios: each round's three steps ran back to back.
        ratios.append(statistics.median(pair_ratios(times, "on")))
        controls.append(statistics.median(pair_ratios(times, "control")))
        table.add_row(
            str(rank), *(f"{median[m] * 1e3:.2f} ms" for m in MODES),
            f"{ratios[-1]:.4f}", f"{controls[-1]:.4f}", str(len(times["off"])),
        )  # fmt: skip
    console.print(table)
    overhead = (statistics.mean(ratios) - 1) * 100
    noise = (statistics.mean(controls) - 1) * 100
    console.print(
        f"telemetry overhead (median of per-round on/off ratios, mean over ranks): "
        f"{overhead:+.2f} % (goal ≤ 1 %); off/off again, the noise floor: {noise:+.2f} %; "
        f"{spans} spans reached the daemon"
    )
    if args.only_steps:
        return

    costs = hook_cost()
    hooks = Table(title="hook cost, one process, no-op backend")
    hooks.add_column("measure")
    hooks.add_column("value", justify="right")
    hooks.add_row("comm op, telemetry off", f"{costs['comm_op_off_us']:.2f} µs")
    hooks.add_row("comm op, telemetry on", f"{costs['comm_op_on_us']:.2f} µs")
    hooks.add_row("step_end with 5 phases + 100 ops", f"{costs['step_end_100_ops_ms']:.2f} ms")
    console.print(hooks)

    ingest = ingest_rate(args.ingest_seconds)
    console.print(
        f"daemon ingest over loopback: {ingest['spans_per_second']:,.0f} spans/s "
        f"({ingest['spans_stored']:,} of {ingest['spans_sent']:,} spans stored); the stock OTLP "
        f"exporter encodes and sends {ingest['exporter_spans_per_second']:,.0f} spans/s"
    )
    console.print(
        f"receiver in process, one thread (parse + decode + store): "
        f"{ingest['reader_spans_per_second']:,.0f} spans/s reading the bytes, "
        f"{ingest['walk_spans_per_second']:,.0f} spans/s walking protobuf messages"
    )


if __name__ == "__main__":
    main()
