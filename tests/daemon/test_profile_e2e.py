"""`plait profile`, `plait stacks` and `plait memory` against a real 2-rank `plait train` that
exports to a daemon in this process: one launch of the job serves every case."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from plait.daemon.control_records import ControlLimits
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc, daemon_pb2, daemon_pb2_grpc
from plait.tools.cli import app
from tests.daemon.trace_reading import read_rank

ROOT = Path(__file__).resolve().parents[2]
JOB = "profiled"
MS_NS = 1_000_000
runner = CliRunner()


def wait_for(predicate, what: str, timeout: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def training() -> Iterator[DaemonServer]:
    """A daemon here, and `plait train` on 2 ranks exporting to it until the module is done."""
    server = DaemonServer("127.0.0.1:0", host_interval=1.0).start()
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    command = [
        sys.executable, "-m", "plait.tools.cli", "train", "configs/tiny.toml",
        "--nproc-per-node", "2", "--set", "train.steps=1000000",
        "--set", f"telemetry.daemon={server.address}", "--set", f"telemetry.job_id={JOB}",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def ranks_polling() -> bool:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            views = server.control.endpoints(JOB, time.time_ns())
            return len(views) == 2 and all(v.polling and v.hello.step >= 3 for v in views)

        wait_for(ranks_polling, "both ranks to train and poll the daemon")
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        server.stop(grace=0.5)


def cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def _absolute_ns(document: dict, ts_us: float) -> int:
    return int(document["otherData"]["base_unix_nano"]) + round(ts_us * 1000)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_profile_of_a_running_job_is_one_trace_of_both_ranks_on_the_daemon_clock(
    training: DaemonServer, tmp_path: Path
) -> None:
    output = tmp_path / "t.json"
    code, printed = cli("profile", "--job", JOB, "--steps", "2", "-o", str(output),
                        "--host", training.address, "--json")  # fmt: skip
    assert code == 0, printed
    answer = json.loads(printed)
    assert (answer["command"], answer["schema_version"], answer["file"]) == (
        "profile", 1, str(output)
    )  # fmt: skip
    start = answer["start_step"]
    document = json.loads(output.read_text())
    processes = document["otherData"]["processes"]
    assert {p["rank"] for p in processes.values()} == {0, 1}
    pid_of = {p["rank"]: int(pid) for pid, p in processes.items()}
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"rank {r} · {processes[str(pid_of[r])]['host']} · cp 0, dp {r}, pp 0, tp 0"
                     for r in (0, 1)}  # fmt: skip

    # The same steps on both ranks, in torch's annotations and in plait's step spans.
    for rank, pid in pid_of.items():
        own = [e for e in events if e["pid"] == pid]
        annotated = sorted(e["name"] for e in own if e["name"].startswith("ProfilerStep#"))
        assert annotated == [f"ProfilerStep#{start}", f"ProfilerStep#{start + 1}"], rank
        plait_steps = sorted(e["args"]["plait.step"] for e in own if e["cat"] == "plait.step")
        assert plait_steps == [start, start + 1], rank
        assert any(e["name"].startswith("aten::") and e["cat"] == "cpu_op" for e in own)
        assert any(e["cat"] == "plait.comm" for e in own) and any(
            e["cat"] == "plait.phase" for e in own
        )

    # plait's spans in the file sit where the daemon's own copy of them sits (within 1 ms),
    # and each step's operators lie inside plait's span of that step.
    channel = grpc.insecure_channel(training.address)
    request = daemon_pb2.CaptureTraceRequest(seconds=0, job_id=JOB)
    captured = json.loads(
        daemon_pb2_grpc.DaemonStub(channel).CaptureTrace(request).chrome_trace_json
    )
    channel.close()
    daemon_steps = {
        (e["pid"], e["args"]["plait.step"]): _absolute_ns(captured, e["ts"])
        for e in captured["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "step"
    }
    for rank, pid in pid_of.items():
        spans = {
            e["args"]["plait.step"]: e
            for e in events
            if e["pid"] == pid and e["cat"] == "plait.step"
        }
        for step, span in spans.items():
            here = _absolute_ns(document, span["ts"])
            assert abs(here - daemon_steps[(rank, step)]) <= MS_NS, (rank, step)
        annotations = {int(e["name"].split("#")[1]): e for e in events
                       if e["pid"] == pid and e["name"].startswith("ProfilerStep#")}  # fmt: skip
        for step, annotation in annotations.items():
            inside = [e for e in events if e["pid"] == pid and e["cat"] == "cpu_op"
                      and e["tid"] == annotation["tid"] and annotation["ts"] <= e["ts"]
                      and e["ts"] + e["dur"] <= annotation["ts"] + annotation["dur"]]  # fmt: skip
            assert inside
            span = spans[step]
            first = min(e["ts"] for e in inside)
            last = max(e["ts"] + e["dur"] for e in inside)
            assert span["ts"] - 1000 <= first and last <= span["ts"] + span["dur"] + 1000, step

    # The analysis printed equals an independent reading of the file.
    figures = {r["rank"]: r for r in answer["analysis"]["ranks"]}
    assert set(figures) == {0, 1}
    for rank, pid in pid_of.items():
        reading = read_rank(document, pid)
        got = figures[rank]
        assert got["steps"] == 2 and reading.steps == (start, start + 1)
        tolerance = {"rel": 0.01, "abs": 2e-4}
        for key, value in (
            ("window_seconds", reading.window),
            ("compute_seconds", reading.compute),
            ("communication_seconds", reading.communication),
            ("memory_seconds", reading.memory),
            ("idle_peer_wait_seconds", reading.idle_peer_wait),
            ("idle_host_seconds", reading.idle_host),
            ("communication_total_seconds", reading.communication_total),
        ):
            assert got[key] == pytest.approx(value, **tolerance), (rank, key)
        assert got["overlap_fraction"] == pytest.approx(reading.overlap, abs=0.01)
        assert got["compute_seconds"] > 0 and got["communication_total_seconds"] > 0
        captured_time = (
            sum(
                e["dur"]
                for e in events
                if e["pid"] == pid and e["name"].startswith("ProfilerStep#")
            )
            / 1e6
        )
        classes = (got["compute_seconds"] + got["communication_seconds"] + got["memory_seconds"]
                   + got["idle_host_seconds"] + got["idle_peer_wait_seconds"])  # fmt: skip
        assert classes == pytest.approx(captured_time, rel=0.02)
    summary = answer["analysis"]["summary"]
    assert summary["slowest_rank"] in (0, 1) and summary["verdict"].startswith(
        f"rank {summary['slowest_rank']} is the slowest"
    )


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_profile_prints_the_breakdown_and_takes_seconds_ranks_options_and_gzip(
    training: DaemonServer, tmp_path: Path
) -> None:
    output = tmp_path / "rank1.json.gz"
    code, printed = cli("profile", "--job", JOB, "--seconds", "0.3", "--ranks", "1",
                        "--with-stack", "--record-shapes",
                        "-o", str(output), "--host", training.address)  # fmt: skip
    assert code == 0, printed
    assert f"wrote {output}: ranks [1] of job {JOB}" in printed
    assert "temporal breakdown" in printed and "is the slowest" not in printed
    assert "rank 1 alone" in printed
    document = json.loads(gzip.decompress(output.read_bytes()))
    assert [p["rank"] for p in document["otherData"]["processes"].values()] == [1]
    steps = {e["name"] for e in document["traceEvents"] if e["name"].startswith("ProfilerStep#")}
    assert len(steps) >= 1
    categories = {e.get("cat") for e in document["traceEvents"]}
    assert "python_function" in categories  # --with-stack
    assert any(e.get("args", {}).get("Input Dims") for e in document["traceEvents"])  # shapes


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_stacks_and_memory_of_a_running_job(training: DaemonServer, tmp_path: Path) -> None:
    code, printed = cli("stacks", "--job", JOB, "--host", training.address, "--json")
    assert code == 0, printed
    answer = json.loads(printed)
    assert sorted(r["rank"] for r in answer["ranks"]) == [0, 1]
    for rank in answer["ranks"]:
        (training_thread,) = [t for t in rank["threads"] if t["training"]]
        functions = [f["function"] for f in training_thread["frames"]]
        assert "run_training" in functions, functions

    code, printed = cli("memory", "--job", JOB, "-o", str(tmp_path / "mem"),
                        "--host", training.address, "--json")  # fmt: skip
    assert code == 0, printed
    answer = json.loads(printed)
    assert sorted(Path(f).name for f in answer["files"]) == [
        "rank0.memory.json",
        "rank1.memory.json",
    ]
    for report in answer["ranks"]:
        state = report["model_state"]
        assert state["parameters"] > 0 and state["optimizer_state"] == 2 * state["parameters"]
        assert report["activations_saved_bytes"] > 0 and report["rss_bytes"] > 0


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_job_that_does_not_exist_is_answered_at_once(
    training: DaemonServer, tmp_path: Path
) -> None:
    refused_before = training.control.refused
    code, printed = cli("profile", "--job", "no-such-job", "--steps", "2", "--timeout", "300",
                        "-o", str(tmp_path / "x.json"), "--host", training.address)  # fmt: skip
    assert code == 1
    assert f"NOT_FOUND: no job 'no-such-job' on this daemon (it knows: {JOB})" in printed
    # Refused when the request was opened, before anything waits (no request to time out).
    assert training.control.refused == refused_before + 1
    assert not (tmp_path / "x.json").exists()


def test_ranks_that_stopped_polling_are_named_at_once(tmp_path: Path) -> None:
    limits = ControlLimits(poll_patience_seconds=0.5)
    with DaemonServer("127.0.0.1:0", host_interval=60.0, control=limits) as server:
        channel = grpc.insecure_channel(server.address)
        stub = control_pb2_grpc.ControlStub(channel)
        for rank in (0, 1):
            stub.Poll(
                control_pb2.PollRequest(job_id="quiet", rank=rank, world_size=2, host="h", step=7)
            )

        def silent() -> bool:
            return not any(v.polling for v in server.control.endpoints("quiet", time.time_ns()))

        wait_for(silent, "the ranks' patience to run out", timeout=60)
        output = str(tmp_path / "q.json")
        code, printed = cli("profile", "--job", "quiet", "--steps", "2", "-o", output,
                            "--host", server.address)  # fmt: skip
        channel.close()
    assert code == 1
    assert "FAILED_PRECONDITION: no addressed rank of job 'quiet' is polling" in printed
    assert re.search(r"rank 0 not polling \(last polled \d+\.\ds ago\)", printed), printed
    assert re.search(r"rank 1 not polling \(last polled \d+\.\ds ago\)", printed), printed
