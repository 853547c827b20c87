"""The job id `plait train` gives its ranks: one per launch unless a rendezvous id names it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plait.tools.cli import app

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def launched_job_id(monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """What PLAIT_JOB_ID the ranks would inherit (torchrun is replaced by a recorder)."""
    import torch.distributed.run

    seen: dict[str, Any] = {}

    def record(parsed: Any) -> None:
        seen["job_id"] = os.environ.get("PLAIT_JOB_ID")
        seen["rdzv_id"] = parsed.rdzv_id

    monkeypatch.setenv("PLAIT_JOB_ID", "restored-after-the-test")
    monkeypatch.delenv("PLAIT_JOB_ID")
    for variable in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setattr(torch.distributed.run, "run", record)
    result = CliRunner().invoke(app, ["train", str(CONFIG), *args])
    assert result.exit_code == 0, result.output
    monkeypatch.delenv("PLAIT_JOB_ID")  # each launch sets it afresh
    return seen["job_id"]


def test_a_single_node_launch_is_named_after_its_config_and_start_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = launched_job_id(monkeypatch)
    assert re.fullmatch(r"tiny-\d{8}-\d{6}", job_id), job_id


def test_a_rendezvous_id_names_the_job_on_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = launched_job_id(
        monkeypatch, "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "exp-42", "--nnodes", "2"
    )
    assert job_id == "exp-42"
    standalone = launched_job_id(monkeypatch, "--rdzv-id", "exp-43")
    assert standalone == "exp-43"
