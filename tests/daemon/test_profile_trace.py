"""Merging ranks' profiler traces: one process per rank, clocks moved by each rank's measured
offset, plait's spans on the same timeline, and the CLI's merge of several daemons' captures."""

from __future__ import annotations

from plait.daemon.chrome_trace import merge_traces
from plait.daemon.profile_trace import FIRST_PROFILER_TID, RankCapture, merge_captures
from tests.daemon.trace_fakes import (
    BASE_NS,
    as_rank_trace,
    comm_span,
    cpu_trace,
    cuda_trace,
    identity,
)

MS = 1_000_000


def _absolute_ns(document: dict, event: dict) -> int:
    return document["otherData"]["base_unix_nano"] + round(event["ts"] * 1000)


def _named(document: dict, pid: int, name: str, cat: str | None = None) -> dict:
    (event,) = [
        e
        for e in document["traceEvents"]
        if e["pid"] == pid
        and e["name"] == name
        and e["ph"] == "X"
        and (cat is None or e["cat"] == cat)
    ]
    return event


def test_each_rank_is_moved_by_its_own_clock_offset() -> None:
    # Rank 1's clock runs 7 ms ahead of the daemon's and it measured -7 ms: after the merge, its
    # events sit where rank 0's equal events sit.
    captures = [
        RankCapture(
            job_id="job",
            rank=rank,
            host="node-a",
            trace=as_rank_trace(
                cpu_trace([("aten::mm", "cpu_op", 1, 100, 50)], {1: (0, 1000)}, base_ns=base)
            ),
            coordinates={"dp": rank, "tp": 0},
            clock_offset_ns=offset,
            clock_rtt_ns=200_000,
        )
        for rank, base, offset in ((0, BASE_NS, 0), (1, BASE_NS + 7 * MS, -7 * MS))
    ]
    document = merge_captures(captures, request_id="profile-1", start_step=1, steps=1)
    mm = [_absolute_ns(document, _named(document, rank, "aten::mm")) for rank in (0, 1)]
    assert mm[0] == mm[1] == BASE_NS + 100_000
    processes = document["otherData"]["processes"]
    assert processes["1"]["clock_offset_ns"] == -7 * MS and processes["1"]["host"] == "node-a"
    names = {
        e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0 · node-a · dp 0, tp 0", 1: "rank 1 · node-a · dp 1, tp 0"}
    assert document["otherData"]["profile"] == {
        "request_id": "profile-1",
        "start_step": 1,
        "steps": 1,
    }


def test_plait_spans_are_overlaid_on_the_rank_clock_corrected_too() -> None:
    span = comm_span(300.0, 400.0, seq=5)  # on the rank's clock, 2 ms ahead
    span.start_ns += 2 * MS
    span.end_ns += 2 * MS
    capture = RankCapture(
        job_id="job",
        rank=0,
        host="node-a",
        trace=as_rank_trace(
            cpu_trace(
                [("aten::mm", "cpu_op", 1, 300, 100)], {1: (0, 1000)}, base_ns=BASE_NS + 2 * MS
            )
        ),
        clock_offset_ns=-2 * MS,
        spans=[(identity(0), span)],
    )
    document = merge_captures([capture])
    overlay = _named(document, 0, "all_reduce", "plait.comm")
    assert overlay["args"]["plait.comm.seq"] == 5
    assert _absolute_ns(document, overlay) == _absolute_ns(
        document, _named(document, 0, "aten::mm")
    )
    threads = {
        e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"
    }
    assert threads[overlay["tid"]] == "plait comm dp"
    assert overlay["tid"] < FIRST_PROFILER_TID <= _named(document, 0, "aten::mm")["tid"]


def test_gpu_streams_become_threads_of_the_rank_and_flows_stay_apart() -> None:
    captures = [
        RankCapture(
            job_id="job", rank=rank, host="node-a", trace=as_rank_trace(cuda_trace(steps=(1,)))
        )
        for rank in (0, 1)
    ]
    document = merge_captures(captures)
    events = document["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}  # host and GPU processes folded into the rank
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (0, "GPU 0 stream 7") in threads and (1, "GPU 0 stream 20 ") in threads
    assert (0, "thread 4242 (python)") in threads
    flows = [e for e in events if e["ph"] in ("s", "f")]
    ids = {rank: {e["id"] for e in flows if e["pid"] == rank} for rank in (0, 1)}
    assert ids[0] and not ids[0] & ids[1]  # correlation ids of two ranks no longer collide
    for rank in (0, 1):  # every flow still starts and ends in the same rank
        starts = {e["id"] for e in flows if e["pid"] == rank and e["ph"] == "s"}
        assert starts == {e["id"] for e in flows if e["pid"] == rank and e["ph"] == "f"}


def test_the_cli_merges_daemons_keeping_each_process_details() -> None:
    def one(rank: int, host: str) -> dict:
        return merge_captures(
            [
                RankCapture(
                    job_id="job",
                    rank=rank,
                    host=host,
                    trace=as_rank_trace(
                        cpu_trace([("aten::mm", "cpu_op", 1, 0, 10)], {1: (0, 100)})
                    ),
                    coordinates={"dp": rank},
                )
            ]
        )

    merged = merge_traces([one(0, "node-a"), one(1, "node-b")])
    processes = merged["otherData"]["processes"]
    assert {p["rank"]: p["host"] for p in processes.values()} == {0: "node-a", 1: "node-b"}
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1}
