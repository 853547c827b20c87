"""What `plait train` prints: one rank's notices, the banner's transforms, the failure line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plait.core.config import load_config
from plait.training.banner import transform_names
from plait.training.launch_errors import failure_line, record_rank_error
from plait.training.rank_notices import quiet_repeated_notices

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_filters() -> Any:
    names = ("plait.plugins.checkpoint.checkpointer", "plait.telemetry")
    yield
    for name in names:
        logger = logging.getLogger(name)
        for f in list(logger.filters):
            logger.removeFilter(f)


def _said(env: dict[str, str], caplog: pytest.LogCaptureFixture) -> list[str]:
    quiet_repeated_notices(env)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("plait.plugins.checkpoint.checkpointer").warning(
            "resumed from %s at step %d", "/ckpt/step-00000004", 4
        )
        logging.getLogger("plait.telemetry").warning(
            "plait telemetry: no daemon reachable at %s", "127.0.0.1:7461"
        )
        logging.getLogger("plait.plugins.checkpoint.checkpointer").warning("something else")
    return [r.getMessage().split(" at")[0] for r in caplog.records]


def test_repeated_notices_come_from_one_rank(
    caplog: pytest.LogCaptureFixture, clean_filters: None
) -> None:
    everything = ["resumed from /ckpt/step-00000004", "plait telemetry: no daemon reachable"]
    everything.append("something else")
    assert _said({"RANK": "0", "LOCAL_RANK": "0"}, caplog) == everything
    # Rank 1 on the first node says neither; local rank 0 of a second node names its own
    # node's missing daemon; anything else is never dropped.
    assert _said({"RANK": "1", "LOCAL_RANK": "1"}, caplog) == ["something else"]
    assert _said({"RANK": "2", "LOCAL_RANK": "0"}, caplog) == everything[1:]


def test_banner_names_every_transform_and_its_options() -> None:
    config = load_config(
        ROOT / "configs/tiny.toml",
        [
            "parallel.tp=2",
            "parallel.dp_strategy=zero3",
            'parallel.transforms={precision="amp", ac="checkpoint"}',
            "comm.algorithm=powersgd",
        ],
    )
    sizes = {"tp": 2, "cp": 1, "pp": 1}
    mesh = SimpleNamespace(size=lambda a: sizes[a], host_map=None)
    engine = SimpleNamespace(config=config, mesh=mesh)
    resolved = {
        "zero3": {"offload": {"device": "cpu"}},
        "megatron": {"sequence_parallel": True},
        "amp": {"dtype": "bf16"},
        "checkpoint": {"mode": "full"},
    }
    line = " · ".join(transform_names(engine, resolved))  # type: ignore[arg-type]
    assert line == (
        "dp strategy zero3 (offload to cpu) · tp megatron (sequence parallel) · "
        "activation checkpointing checkpoint (full) · precision amp (bf16) · "
        "schedule accumulate · comm powersgd · grad-norm clip 1"
    )


class _Failure:
    def __init__(self, exitcode: int, error_file: Path | None) -> None:
        self.exitcode = exitcode
        self.error_file_data = json.loads(error_file.read_text()) if error_file else {}

    def signal_name(self) -> str:
        return "SIGTERM"


class _ChildFailed:
    def __init__(self, failures: dict[int, _Failure]) -> None:
        self.failures = failures

    def format_msg(self) -> str:
        return "torchrun's report"


def test_the_failure_line_names_the_first_rank_and_keeps_the_rest(tmp_path: Path) -> None:
    files = {}
    for rank, exc in ((3, RuntimeError("Connection closed by peer")), (1, ValueError("bad"))):
        files[rank] = tmp_path / f"error-{rank}.json"
        try:
            raise exc
        except Exception as raised:
            assert record_rank_error(raised, {"TORCHELASTIC_ERROR_FILE": str(files[rank])})
    assert not record_rank_error(ValueError("x"), {})  # no torchrun: the caller prints
    failures = {
        0: _Failure(-15, None),  # stopped by torchrun, no message
        1: _Failure(1, files[1]),
        3: _Failure(1, files[3]),
    }
    log = tmp_path / "launch.log"
    line = failure_line(_ChildFailed(failures), log, ["launcher line"])
    # Rank 3 wrote its error first (the files are written in that order).
    assert line == (
        "rank 3 failed: RuntimeError: Connection closed by peer; 2 other ranks stopped after it "
        f"(full report: {log})"
    )
    report = log.read_text()
    assert report.startswith("launcher line\n\ntorchrun's report")
    assert "rank 1 (exit code 1): ValueError: bad" in report and "killed by SIGTERM" in report
    assert report.count("Traceback (most recent call last)") == 2
