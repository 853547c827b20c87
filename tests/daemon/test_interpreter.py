"""The daemon process's interpreter: quick lock hand-overs while it serves; its collector's
survivors frozen out of the walks, cycles still reclaimed, and the daemon's hot paths forming no
cycles (what makes freezing safe)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import subprocess
import sys
import time
import types
import weakref
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import plait
from plait.daemon.interpreter import (
    SWITCH_INTERVAL_SECONDS,
    FreezeSurvivors,
    serving_interpreter,
)
from plait.daemon.server import DaemonServer
from plait.tools.bench.daemon_load import export_like_a_rank
from tests.daemon.otlp_inputs import SpanSpec, probe, rank_resource, step_spans, trace_request

PLAIT_DIR = str(Path(plait.__file__).parent)


class Node:
    """A tracked container; `partner` makes a cycle."""

    def __init__(self) -> None:
        self.partner: Node | None = None


@pytest.fixture
def freezing() -> Iterator[FreezeSurvivors]:
    gc.collect()
    with FreezeSurvivors() as policy:
        yield policy
    gc.collect()


def test_what_survives_a_collection_is_never_walked_again(freezing: FreezeSurvivors) -> None:
    window = [Node() for _ in range(10_000)]  # what a store keeps
    gc.collect(0)  # any collection, as an allocation would trigger one
    walked = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
    assert not any(id(node) in walked for node in window)
    assert gc.get_freeze_count() >= len(window)


def test_a_frozen_object_is_still_freed_when_dropped(freezing: FreezeSurvivors) -> None:
    node = Node()
    gc.collect(0)
    dead = weakref.ref(node)
    del node  # reference counting, no collector
    assert dead() is None


def test_a_cycle_frozen_while_alive_is_reclaimed_by_the_full_collection(
    freezing: FreezeSurvivors,
) -> None:
    first, second = Node(), Node()
    first.partner, second.partner = second, first
    gc.collect(0)  # frozen while still referenced
    dead = weakref.ref(first)
    del first, second
    gc.collect()  # a collection of every generation does not walk the frozen
    assert dead() is not None
    assert freezing.collect_all() >= 2
    assert dead() is None
    assert freezing.full_collections == 1


@pytest.mark.timeout(60)
def test_the_youngest_generation_is_collected_without_waiting_for_allocations() -> None:
    """A full window allocates as much as it frees, so CPython's own trigger rarely fires:
    the policy collects (and freezes) on its own clock."""
    gc.collect()
    gc.disable()  # CPython's own trigger never fires here
    try:
        with FreezeSurvivors(young_collection_seconds=0.01):
            window = [Node() for _ in range(100)]
            ids = {id(node) for node in window}
            while any(id(o) in ids for gen in range(3) for o in gc.get_objects(gen)):
                time.sleep(0.01)  # until the policy's thread has collected once
            assert gc.get_freeze_count() >= len(window)
    finally:
        gc.enable()


SERVE_UNTIL_STOPPED = """
import gc, os, signal, sys, threading, time
from plait.daemon.interpreter import FreezeSurvivors
from plait.daemon.server import DaemonServer, serve

def installed():
    return [c for c in gc.callbacks if isinstance(getattr(c, "__self__", None), FreezeSurvivors)]

def stop_once_serving():
    deadline = time.monotonic() + 60
    while not installed() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("serving", len(installed()), gc.get_freeze_count() > 0, sys.getswitchinterval(),
          flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_once_serving, daemon=True).start()
serve(DaemonServer("127.0.0.1:0"), grace=1.0)
print("stopped", len(installed()), gc.get_freeze_count(), sys.getswitchinterval(), flush=True)
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
        f"serving 1 True {SWITCH_INTERVAL_SECONDS}",
        f"stopped 0 0 {default}",
    ]


@pytest.mark.parametrize("freeze", [True, False])
def test_serving_settings_are_undone_on_exit(freeze: bool) -> None:
    default = sys.getswitchinterval()
    with serving_interpreter(freeze_survivors=freeze):
        assert sys.getswitchinterval() == SWITCH_INTERVAL_SECONDS
        gc.collect(0)
        assert (gc.get_freeze_count() > 0) is freeze
    assert sys.getswitchinterval() == default
    assert gc.get_freeze_count() == 0
    with serving_interpreter(switch_interval_seconds=None):
        assert sys.getswitchinterval() == default


def test_leaving_unfreezes_everything() -> None:
    with FreezeSurvivors():
        kept = [Node() for _ in range(100)]
        gc.collect(0)
        assert gc.get_freeze_count() >= len(kept)
    assert gc.get_freeze_count() == 0
    assert not any(isinstance(getattr(c, "__self__", None), FreezeSurvivors) for c in gc.callbacks)


@pytest.mark.parametrize("period", ["young_collection_seconds", "full_collection_seconds"])
@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_collection_period_must_be_positive(period: str, seconds: float) -> None:
    with pytest.raises(ValueError, match=f"{period} must be > 0"):
        FreezeSurvivors(**{period: seconds})


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
def test_ingest_queries_and_streams_form_no_reference_cycles() -> None:
    """What the daemon does all day leaves nothing for the collector: a rank exporting through
    plait's telemetry (steps, phases, collectives, heartbeats, control polls, its end), a stock
    SDK request with a rejected span and a resource that is no rank, and every query. The rank
    runs in a process of its own: its side (plugin manager, channel) is not the daemon's heap."""
    bad = step_spans(0, 2, 1_000_000_000)
    bad.append(SpanSpec("plait.step", 5, 1, {"plait.step": -3}))  # ends before it starts
    with DaemonServer("127.0.0.1:0", prometheus="127.0.0.1:0") as server:
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
            gc.collect()
            garbage = [_describe(o) for o in gc.garbage if _ours(o)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert rank.exitcode == 0
    assert garbage == [], "\n".join(garbage)
