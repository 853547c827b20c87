"""The daemon process's interpreter while it serves: quick lock hand-overs, no automatic
collection, cycles still reclaimed on a schedule, and the daemon's hot paths forming no cycles
(what makes turning automatic collection off safe)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import subprocess
import sys
import time
import types
import weakref
from pathlib import Path

import grpc
import pytest

import plait
from plait.daemon.interpreter import (
    SWITCH_INTERVAL_SECONDS,
    ScheduledCollections,
    serving_interpreter,
)
from plait.daemon.server import DaemonServer
from plait.tools.bench.daemon_load import export_like_a_rank
from tests.daemon.otlp_inputs import SpanSpec, probe, rank_resource, step_spans, trace_request
from tests.daemon.otlp_sink import OtlpSink

PLAIT_DIR = str(Path(plait.__file__).parent)


class Node:
    """A tracked container; `partner` makes a cycle."""

    def __init__(self) -> None:
        self.partner: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A reference cycle nothing else holds: only the collector reclaims it."""
    first, second = Node(), Node()
    first.partner, second.partner = second, first
    return weakref.ref(first)


def test_no_automatic_collection_while_entered() -> None:
    gc.collect()
    with ScheduledCollections(every_seconds=3600):
        assert not gc.isenabled()
        dead = [cycle() for _ in range(2 * gc.get_threshold()[0])]  # past the threshold
        assert all(ref() is not None for ref in dead)
    assert gc.isenabled()
    gc.collect()
    assert all(ref() is None for ref in dead)


@pytest.mark.timeout(60)
def test_cycles_are_reclaimed_on_the_schedule() -> None:
    with ScheduledCollections(every_seconds=0.01) as collections:
        dead = cycle()
        while dead() is not None or collections.collections == 0:
            time.sleep(0.01)  # until the schedule's thread has reclaimed it


def test_collection_stays_off_when_it_was_off() -> None:
    gc.disable()
    try:
        with ScheduledCollections():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_schedule_must_be_positive(seconds: float) -> None:
    with pytest.raises(ValueError, match="every_seconds must be > 0"):
        ScheduledCollections(every_seconds=seconds)


SERVE_UNTIL_STOPPED = """
import gc, os, signal, sys, threading, time
from plait.daemon.server import DaemonServer, serve

def stop_once_serving():
    deadline = time.monotonic() + 60
    while gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("serving", gc.isenabled(), sys.getswitchinterval(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_once_serving, daemon=True).start()
serve(DaemonServer("127.0.0.1:0"), grace=1.0)
print("stopped", gc.isenabled(), sys.getswitchinterval(), flush=True)
"""


def test_the_daemon_process_serves_with_its_interpreter_set() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVE_UNTIL_STOPPED],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    default = sys.getswitchinterval()
    assert done.stdout.split("\n")[:2] == [
        f"serving False {SWITCH_INTERVAL_SECONDS}",
        f"stopped True {default}",
    ]


@pytest.mark.parametrize("scheduled", [True, False])
def test_serving_settings_are_undone_on_exit(scheduled: bool) -> None:
    default = sys.getswitchinterval()
    with serving_interpreter(scheduled_collections=scheduled):
        assert sys.getswitchinterval() == SWITCH_INTERVAL_SECONDS
        assert gc.isenabled() is not scheduled
    assert sys.getswitchinterval() == default
    assert gc.isenabled()
    with serving_interpreter(switch_interval_seconds=None):
        assert sys.getswitchinterval() == default


def _ours(obj: object) -> bool:
    """Whether a collected object belongs to plait or gRPC (a cycle the daemon made)."""
    if isinstance(obj, types.FrameType):
        return obj.f_code.co_filename.startswith(PLAIT_DIR)
    if isinstance(obj, types.FunctionType):
        return (obj.__module__ or "").startswith("plait")
    return (type(obj).__module__ or "").startswith(("plait", "grpc"))


def _describe(obj: object) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename}:{obj.f_lineno})"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ingest_workers", [0, 1], ids=["decoded-here", "decoded-by-a-worker"])
def test_ingest_queries_and_streams_form_no_reference_cycles(ingest_workers: int) -> None:
    """What the daemon does all day leaves nothing for the collector: a rank exporting through
    plait's telemetry (steps, phases, collectives, heartbeats, control polls, its end), a stock
    SDK request with a rejected span and a resource that is no rank, forwarding upstream, and
    every query. The rank runs in a process of its own: its side (plugin manager, channel) is
    not the daemon's heap."""
    bad = step_spans(0, 2, 1_000_000_000)
    bad.append(SpanSpec("plait.step", 5, 1, {"plait.step": -3}))  # ends before it starts
    with (
        OtlpSink() as sink,
        DaemonServer(
            "127.0.0.1:0",
            prometheus="127.0.0.1:0",
            otlp_endpoint=sink.endpoint,
            ingest_workers=ingest_workers,
            ingest_offload_bytes=1,  # with a worker, every trace request goes to it
        ) as server,
    ):
        export_like_a_rank(server.address, 0, 2, 0.5)  # every code path once: caches filled
        probe(server)
        rank = mp.get_context("spawn").Process(
            target=export_like_a_rank, args=(server.address, 1, 2, 1.0)
        )
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            rank.start()
            rank.join(timeout=120)
            with grpc.insecure_channel(server.address) as channel:
                export = channel.unary_unary(
                    "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                    request_serializer=lambda message: message.SerializeToString(),
                    response_deserializer=lambda data: data,
                )
                export(trace_request(rank_resource("cycles", 0), bad), timeout=10)
                export(trace_request({"service.name": "not-a-rank"}, bad), timeout=10)
            for _ in range(3):
                probe(server)
            assert server.upstream is not None
            server.upstream.meter_provider.force_flush(5000)
            assert sink.wait_for(lambda s: any(r.get("plait.rank") == 1 for r, _ in s.spans))
            gc.collect()
            garbage = [_describe(o) for o in gc.garbage if _ours(o)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert rank.exitcode == 0
    assert garbage == [], "\n".join(garbage)
