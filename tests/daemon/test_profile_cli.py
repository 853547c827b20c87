"""`plait profile` on its own: arguments checked before any call, and several daemons' captures
merged on one clock (each daemon's offset measured, here replaced by known offsets)."""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from plait.daemon.profile_trace import RankCapture, merge_captures
from plait.proto.plait.v1 import control_pb2
from plait.tools import profile_commands
from plait.tools.cli import app
from tests.daemon.trace_fakes import BASE_NS, as_rank_trace, cpu_trace

runner = CliRunner()
MS = 1_000_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "2", "--seconds", "1"], "give --steps N or --seconds S"),
        ([], "give --steps N or --seconds S"),
        (["--steps", "2", "-o", "trace.txt"], "-o must name a .json or .json.gz file"),
        (["--steps", "2", "--ranks", "0,x"], "--ranks takes rank numbers like 0,1,4"),
    ],
)
def test_arguments_are_checked_before_any_daemon_is_asked(args: list[str], message: str) -> None:
    if "-o" not in args:
        args = [*args, "-o", "t.json"]
    result = runner.invoke(
        app, ["profile", "--job", "j", *args, "--host", "127.0.0.1:1"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2, result.output
    assert message in result.output


def _response(rank: int, host: str, base_ns: int) -> control_pb2.ProfileResponse:
    """One daemon's capture of one rank whose only operator starts 100 µs after `base_ns` on
    that daemon's clock."""
    document = merge_captures(
        [
            RankCapture(
                job_id="j",
                rank=rank,
                host=host,
                trace=as_rank_trace(
                    cpu_trace([("aten::mm", "cpu_op", 1, 100, 10)], {1: (0, 200)}, base_ns=base_ns)
                ),
            )
        ],
        start_step=1,
        steps=1,
    )
    return control_pb2.ProfileResponse(
        request_id=f"profile-{rank}",
        trace_json_gz=gzip.compress(json.dumps(document).encode()),
        start_step=1,
        steps=1,
    )


def test_several_daemons_are_merged_on_the_first_daemons_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Daemon B's clock runs 5 ms ahead of daemon A's: the same instant reads 5 ms later there.
    monkeypatch.setattr(
        profile_commands, "daemon_clock_offsets", lambda hosts: {"a:1": 2 * MS, "b:1": 7 * MS}
    )
    collected = {
        "a:1": _response(0, "node-a", BASE_NS),
        "b:1": _response(1, "node-b", BASE_NS + 5 * MS),
    }
    document, analysis = profile_commands.merged_capture(collected)
    base = document["otherData"]["base_unix_nano"]
    starts = {
        e["pid"]: base + round(e["ts"] * 1000)
        for e in document["traceEvents"]
        if e.get("name") == "aten::mm"
    }
    assert starts == {0: BASE_NS + 100_000, 1: BASE_NS + 100_000}
    processes = document["otherData"]["processes"]
    assert {p["rank"]: p["daemon_clock_offset_ns"] for p in processes.values()} == {0: 0, 1: 5 * MS}
    assert sorted(r.rank for r in analysis.ranks) == [0, 1]
    assert document["otherData"]["profile"]["requests"] == {"a:1": "profile-0", "b:1": "profile-1"}
