"""What ranks deliver is checked at the door: a bad delivery is refused with its reason, a bad
event inside a good one is dropped alone and counted, a snapshot is never unpickled."""

from __future__ import annotations

import gzip
import json
import pickle

import pytest

from plait.daemon.deliveries import BadDelivery, read_memory, read_stacks, read_trace


def _gz(document: object) -> bytes:
    return gzip.compress(json.dumps(document).encode())


def test_a_good_trace_is_read_and_bad_events_are_dropped_alone() -> None:
    good = {"ph": "X", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 2.0}
    trace = read_trace(
        _gz(
            {
                "baseTimeNanoseconds": 123,
                "deviceProperties": [],
                "traceEvents": [
                    good,
                    {"ph": "X", "name": "x", "pid": 1, "tid": 1, "ts": "soon", "dur": 1},
                    {"ph": "X", "name": "x", "pid": 1, "tid": 1, "ts": 1.0, "dur": -4},
                    {"name": "no phase"},
                    "not an object",
                    {"ph": "X", "name": "x", "pid": [1], "tid": 1, "ts": 1.0, "dur": 1},
                ],
            }
        )
    )
    assert trace.events == [good] and trace.base_ns == 123
    assert dict(trace.dropped) == {
        "ts: not a finite number": 1,
        "dur: not a finite number >= 0": 1,
        "ph: missing": 1,
        "not an object": 1,
        "pid/tid: not an int or string": 1,
    }


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"plain bytes", "not gzip"),
        (gzip.compress(b"{not json"), "not JSON"),
        (_gz({"events": []}), "no traceEvents"),
        (_gz({"traceEvents": [], "baseTimeNanoseconds": -1}), "baseTimeNanoseconds"),
        (gzip.compress(b'{"traceEvents": []}')[:-6], "truncated"),
    ],
)
def test_a_trace_that_cannot_be_used_is_refused_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(BadDelivery, match=reason):
        read_trace(data)


def test_a_small_gzip_that_expands_without_bound_is_refused() -> None:
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * (64 * 2**20) + b"]}")
    assert len(bomb) < 2**20
    with pytest.raises(BadDelivery, match="decompresses to more than"):
        read_trace(bomb)


def test_stacks_are_typed_records_and_bad_ones_name_the_field() -> None:
    record = read_stacks(
        json.dumps(
            {
                "pid": 7,
                "step": 3,
                "taken_unix_nano": 1,
                "in_flight": ["all_reduce seq 2 on dp [0, 1], 4.0s"],
                "threads": [
                    {
                        "thread_id": 1,
                        "name": "MainThread",
                        "training": True,
                        "daemon": False,
                        "frames": [{"file": "a.py", "line": 3, "function": "f", "code": "x()"}],
                    }
                ],
            }
        ).encode()
    )
    assert record.threads[0].frames[0].function == "f" and record.threads[0].training
    bad = {
        "threads": [{"thread_id": 1, "frames": [{"file": "a.py", "line": "3", "function": "f"}]}]
    }
    with pytest.raises(BadDelivery, match=r"threads\[0\]\.frames\[0\]\.line"):
        read_stacks(json.dumps(bad).encode())
    with pytest.raises(BadDelivery, match="no threads list"):
        read_stacks(b"[]")


def test_memory_files_pass_through_and_only_known_names_are_taken() -> None:
    snapshot = pickle.dumps({"segments": []})
    files = read_memory({"memory.json": b'{"rss_bytes": 1}', "snapshot.pickle": snapshot})
    assert files["snapshot.pickle"] == snapshot
    with pytest.raises(BadDelivery, match="unexpected parts"):
        read_memory({"memory.json": b"{}", "../../etc/passwd": b""})
    with pytest.raises(BadDelivery, match="not a JSON object"):
        read_memory({"memory.json": b"[1]"})
