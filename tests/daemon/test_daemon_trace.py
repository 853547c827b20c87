"""CaptureTrace and `plait trace`: the output validates as Chrome trace events."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest

from plait.daemon import service as service_module
from plait.daemon import telemetry_schema as names
from plait.daemon.chrome_trace import merge_traces
from plait.plugins.telemetry.rank_telemetry import RankTelemetry
from plait.proto.plait.v1 import daemon_pb2
from tests.daemon.daemon_fakes import PHASES, FakeBackend, job_info, run_fake_rank


def validate_chrome_trace(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the Chrome trace event format; return the complete ("X") events."""
    assert isinstance(document["traceEvents"], list)
    complete = []
    for event in document["traceEvents"]:
        for key in ("name", "ph", "ts", "pid", "tid"):
            assert key in event, (key, event)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert event["ph"] in ("X", "M"), event
        if event["ph"] == "X":
            assert isinstance(event["ts"], int | float) and event["ts"] >= 0
            assert isinstance(event["dur"], int | float) and event["dur"] >= 0
            complete.append(event)
        else:
            assert event["name"] in ("process_name", "process_sort_index", "thread_name")
            assert isinstance(event["args"], dict)
    return complete


def test_trace_has_every_collective_and_phase(daemon_server, daemon_stub) -> None:
    backends = [FakeBackend(), FakeBackend()]
    for rank, backend in enumerate(backends):
        run_fake_rank(daemon_server.address, rank=rank, steps=2, backend=backend)
    response = daemon_stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=0))
    document = json.loads(response.chrome_trace_json)
    events = validate_chrome_trace(document)
    assert list(response.ranks) == [0, 1] and response.span_count == len(events)
    assert {e["pid"] for e in events} == {0, 1}

    sent = Counter(
        (rank, r.op, r.group_name, r.seq) for rank, b in enumerate(backends) for r in b.requests
    )
    traced = Counter(
        (e["pid"], e["name"], e["args"][names.SPAN_COMM_GROUP], e["args"][names.SPAN_COMM_SEQ])
        for e in events
        if e["cat"] == "comm"
    )
    assert traced == sent and sum(sent.values()) == 2 * 2 * 3
    phases = Counter((e["pid"], e["name"]) for e in events if e["cat"] in ("phase", "data"))
    assert phases == Counter({(rank, p): 2 for rank in (0, 1) for p in PHASES})
    steps = [e for e in events if e["cat"] == "step"]
    assert len(steps) == 4 and all(e["dur"] == 500_000 for e in steps)  # 0.5 s in µs
    # a rank's comm ops sit on their group's track, its phases on the compute track
    comm_tids = {e["tid"] for e in events if e["cat"] == "comm"}
    phase_tids = {e["tid"] for e in events if e["cat"] == "phase"}
    assert len(comm_tids) == 1 and comm_tids.isdisjoint(phase_tids)
    names_meta = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"]
                  if e["name"] == "thread_name"}  # fmt: skip
    assert names_meta[(0, comm_tids.pop())] == "comm dp"


def test_timed_capture_only_holds_spans_started_during_it(
    daemon_server, daemon_stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window is a matter of span start times, so the test sets them and the capture's own
    # start (the daemon's clock) instead of racing a capture thread with a sleep.
    capture_start = time.time_ns()
    monkeypatch.setattr(service_module, "time", _FrozenWallClock(capture_start))
    telemetry = RankTelemetry.start(job_info(job_id="job-b"), daemon_server.address)
    assert telemetry is not None
    for name, step, offset in (("before", 6, -1.0), ("during", 7, 0.5), ("after", 8, 1.5)):
        start = capture_start + int(offset * 1e9)
        span = telemetry.tracer.start_span(
            name, attributes={names.SPAN_STEP: step}, start_time=start
        )
        span.end(end_time=start + 1000)
    telemetry.flush()
    telemetry.shutdown()
    deadline = time.monotonic() + 60  # the daemon ingests off the receiving thread
    while daemon_server.store.spans_received < 3:
        assert time.monotonic() < deadline, "the daemon never stored the three spans"
        time.sleep(0.02)
    response = daemon_stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=1.0))
    events = validate_chrome_trace(json.loads(response.chrome_trace_json))
    assert [(e["name"], e["args"][names.SPAN_STEP]) for e in events] == [("during", 7)]


class _FrozenWallClock:
    """`time` for the daemon's service module: wall-clock time stands at `now_ns`."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def time_ns(self) -> int:
        return self.now_ns

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_merge_rebases_hosts_on_one_timeline() -> None:
    def doc(base: int, pid: int) -> dict[str, Any]:
        event = {"name": "step", "ph": "X", "ts": 0.0, "dur": 5.0, "pid": pid, "tid": 0}
        return {"traceEvents": [event], "otherData": {"base_unix_nano": base}}

    merged = merge_traces([doc(2_000_000, 1), doc(1_000_000, 0)])
    events = validate_chrome_trace(merged)
    assert [(e["pid"], e["ts"]) for e in events] == [(0, 0.0), (1, 1000.0)]
