"""What `plait train` says about its checkpoints: the banner names where they go, how often
and whether the step waits for their writes; the summary counts the saves published and what
they cost the steps. Through `run_training` in one process, as each rank of `plait train`."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from plait.core.config import load_config
from plait.training.loop import run_training

ROOT = Path(__file__).resolve().parents[2]


def _output(tmp_path: Path, *overrides: str) -> str:
    settings = [
        "data.seq_len=32",
        "train.steps=4",
        "train.global_batch_size=2",
        "telemetry.enabled=false",
        f"checkpoint_io.dir={tmp_path / 'ckpt'}",
        "checkpoint_io.every=2",
        *overrides,
    ]
    out = io.StringIO()
    run_training(
        load_config(ROOT / "configs/tiny.toml", settings),
        console=Console(file=out, width=300, force_terminal=False),
    )
    return out.getvalue()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_banner_and_the_summary_speak_of_the_checkpoints(
    tmp_path: Path, asynchronous: bool
) -> None:
    output = _output(tmp_path, f"checkpoint_io.async_save={str(asynchronous).lower()}")
    how = "asynchronous (the step waits for a host copy" if asynchronous else "synchronous"
    assert f"checkpoints: every 2 steps to {tmp_path / 'ckpt'} · {how}" in output, output
    saved = re.search(r"checkpoints: (\d+) saved \(last at step (\d+)\) .* written in", output)
    assert saved is not None and saved.groups() == ("2", "4"), output
    assert ("2 in the background" in output) is asynchronous
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        "step-00000002",
        "step-00000004",
    ]
