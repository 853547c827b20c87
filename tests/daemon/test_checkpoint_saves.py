"""A job's checkpoint saves, from the checkpointer's rank 0 to `plait status`.

The saves of a short in-process training run are taken from the span board exactly as the
checkpointer published them, sent to a real daemon over OTLP as the telemetry sends them, and
read back with `plait status` (text and `--json`): the last save, a save being written, a failed
save with its error. The door rejects a checkpoint span that lies.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from rich.console import Console
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.core.span_board import BOARD
from plait.daemon import telemetry_schema as schema
from plait.daemon.checkpoint_log import CheckpointLog, CheckpointSaveRecord, checkpoint_figures
from plait.daemon.decoder import Rejected, decode_span
from plait.daemon.server import DaemonServer
from plait.plugins.checkpoint import checkpointer as checkpointer_module
from plait.plugins.checkpoint.save_events import CheckpointSaveSpan
from plait.tools import daemon_commands
from plait.training.loop import run_training
from tests.daemon.otlp_inputs import SpanSpec, rank_resource, step_spans, trace_request

ROOT = Path(__file__).resolve().parents[2]
JOB = "ckpt-job"


def _train(tmp_path: Path, *overrides: str) -> list[CheckpointSaveSpan]:
    """A 4-step run saving every 2 steps (telemetry off: nobody takes the board); what the
    checkpointer published, in order."""
    BOARD.take()
    settings = [
        "data.seq_len=32",
        "train.steps=4",
        "train.global_batch_size=2",
        "telemetry.enabled=false",
        f"checkpoint_io.dir={tmp_path / 'ckpt'}",
        "checkpoint_io.every=2",
        *overrides,
    ]
    run_training(
        load_config(ROOT / "configs/tiny.toml", settings),
        console=Console(file=io.StringIO(), width=200),
    )
    return [s for s in BOARD.take() if isinstance(s, CheckpointSaveSpan)]


def _send(server: DaemonServer, saves: list[CheckpointSaveSpan], *, steps: int = 4) -> None:
    """The job's steps, then the saves' spans as the telemetry's exporter sends them."""
    specs = step_spans(0, steps, time.time_ns() - steps * 10**8)
    for save in saves:
        specs += [
            SpanSpec(s.name, s.start_ns, s.end_ns, dict(s.attributes)) for s in save.spans(-1)
        ]
    request = trace_request(rank_resource(JOB, 0, world_size=1), specs)
    with grpc.insecure_channel(server.address) as channel:
        response = trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)
    assert not response.partial_success.rejected_spans, response


def _status(server: DaemonServer, *options: str) -> str:
    result = CliRunner().invoke(
        daemon_commands.app, ["status", *options, "--host", server.address], terminal_width=200
    )
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def _checkpoints(server: DaemonServer) -> dict[str, Any]:
    document = json.loads(_status(server, "--json"))
    (job,) = [j for j in document["jobs"] if j["job_id"] == JOB]
    assert job["checkpoints"] is not None, job
    return job["checkpoints"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_checkpointers_saves_show_in_plait_status(
    tmp_path: Path, daemon_server: DaemonServer, asynchronous: bool
) -> None:
    saves = _train(tmp_path, f"checkpoint_io.async_save={str(asynchronous).lower()}")
    # Rank 0 told each save's start, then its write's end, in order.
    assert [(s.step, s.outcome) for s in saves] == [
        (2, "started"),
        (2, "saved"),
        (4, "started"),
        (4, "saved"),
    ]
    last = saves[-1]
    assert {s.asynchronous for s in saves} == {asynchronous}
    assert last.end_ns >= saves[-2].start_ns
    assert last.write_s > 0 and last.write_s * 1e9 <= last.end_ns - last.start_ns + 10**6
    files = (tmp_path / "ckpt" / "step-00000004").iterdir()
    assert last.nbytes == sum(f.stat().st_size for f in files if f.name != "manifest.json")

    _send(daemon_server, saves)
    checkpoints = _checkpoints(daemon_server)
    assert checkpoints["writing"] is None
    assert (checkpoints["saves"], checkpoints["failed"]) == (2, 0)
    shown = checkpoints["last"]
    assert (shown["step"], shown["outcome"], shown["asynchronous"]) == (4, "saved", asynchronous)
    assert shown["write_seconds"] == pytest.approx(last.write_s)
    assert shown["blocked_seconds"] == pytest.approx(last.blocked_s)
    assert shown["bytes"] == last.nbytes
    assert 0 <= shown["age_seconds"] < 120

    # The next save starts: it is being written, the last one still shown.
    _send(daemon_server, [CheckpointSaveSpan.started(step=6, asynchronous=True)], steps=6)
    checkpoints = _checkpoints(daemon_server)
    assert checkpoints["writing"]["step"] == 6 and checkpoints["writing"]["outcome"] == "writing"
    assert checkpoints["last"]["step"] == 4
    text = _status(daemon_server)
    assert re.search(r"checkpoint: writing step 6 since [\d.]+ s \(asynchronous\)", text), text
    how = "asynchronous" if asynchronous else "synchronous"
    assert re.search(
        rf"checkpoint: step 4 saved in [\d.]+ s \({how}, [\d.]+ MB, the step waited "
        r"[\d.]+ s\), [\d.]+ s ago",
        text,
    ), text


@pytest.mark.timeout(300)
def test_a_failed_save_names_its_error(
    tmp_path: Path, daemon_server: DaemonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError("[Errno 28] No space left on device\nwhile writing __0_0.distcp")

    monkeypatch.setattr(checkpointer_module, "save_state_dict", full_disk)
    saves = _train(tmp_path)
    failed = [s for s in saves if s.outcome == "failed"]
    assert [s.step for s in failed] == [2, 4], saves
    assert failed[0].nbytes is None
    assert failed[0].attributes()[schema.SPAN_CHECKPOINT_ERROR] == (
        "OSError: [Errno 28] No space left on device"
    )

    _send(daemon_server, saves)
    checkpoints = _checkpoints(daemon_server)
    assert (checkpoints["saves"], checkpoints["failed"]) == (2, 2)
    assert checkpoints["last"]["outcome"] == "failed"
    text = _status(daemon_server)
    assert re.search(
        r"checkpoint: step 4 failed after [\d.]+ s \(asynchronous\): OSError: \[Errno 28\] No "
        r"space left on device, [\d.]+ s ago",
        text,
    ), text


def _record(save: CheckpointSaveSpan) -> CheckpointSaveRecord:
    (span,) = save.spans(-1)
    decoded = decode_span(span.name, span.start_ns, span.end_ns, dict(span.attributes))
    assert decoded.kind == schema.SPAN_KIND_CHECKPOINT and decoded.checkpoint is not None
    return CheckpointSaveRecord(decoded.checkpoint, decoded.start_ns, decoded.end_ns)


def test_a_save_is_being_written_from_its_start_to_its_end_whatever_order_they_arrive() -> None:
    started = CheckpointSaveSpan.started(step=10, asynchronous=False)
    ended = CheckpointSaveSpan.ended(
        step=10,
        asynchronous=False,
        start_ns=started.start_ns,
        blocked_s=0.5,
        write_s=0.4,
        nbytes=1000,
    )
    log = CheckpointLog()
    log.add(_record(ended))  # one batch, the end first
    log.add(_record(started))
    assert log.writing is None
    figures = checkpoint_figures(log, now_ns=ended.end_ns + 2 * 10**9, running=True)
    assert figures is not None and figures.writing is None and figures.last is not None
    assert (figures.last.step, figures.last.outcome, figures.last.nbytes) == (10, "saved", 1000)
    assert figures.last.age_seconds == pytest.approx(2.0)

    following = CheckpointSaveSpan.started(step=20, asynchronous=False)
    log.add(_record(following))
    assert log.writing is not None and log.writing.figures.step == 20
    figures = checkpoint_figures(log, now_ns=following.start_ns + 10**9, running=True)
    assert figures is not None and figures.writing is not None
    assert figures.writing.age_seconds == pytest.approx(1.0)
    # A job that ended mid-save is not shown writing.
    stopped = checkpoint_figures(log, now_ns=following.start_ns, running=False)
    assert stopped is not None and stopped.writing is None


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        (schema.SPAN_CHECKPOINT_OUTCOME, "exploded"),
        (schema.SPAN_CHECKPOINT_WRITE, -1.0),
        (schema.SPAN_CHECKPOINT_BLOCKED, float("nan")),
        (schema.SPAN_CHECKPOINT_STEP, -3),
        (schema.SPAN_CHECKPOINT_BYTES, "many"),
        (schema.SPAN_CHECKPOINT_ASYNC, "yes"),
    ],
)
def test_the_door_rejects_a_checkpoint_span_that_lies(attribute: str, value: Any) -> None:
    save = CheckpointSaveSpan.ended(
        step=4, asynchronous=True, start_ns=1, blocked_s=0.1, write_s=0.2, nbytes=10
    )
    (span,) = save.spans(-1)
    attributes = {**span.attributes, attribute: value}
    with pytest.raises(Rejected) as rejected:
        decode_span(span.name, span.start_ns, span.end_ns, attributes)
    assert rejected.value.attribute == attribute
