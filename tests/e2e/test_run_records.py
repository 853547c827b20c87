"""Run records of `run_training` in one process: metrics.jsonl and the TensorBoard events hold
every step once across a failed attempt and its resume, validation loss is logged on the held-out
split, and the summary counts the whole run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from plait.core.config import load_config
from plait.training.loop import TrainingSummary, run_training

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "telemetry.enabled=false",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.log_every=4",
]


def _train(tmp_path: Path, steps: int, *extra: str) -> tuple[TrainingSummary, str]:
    overrides = [
        *SETTINGS,
        f"train.steps={steps}",
        f"train.run_dir={tmp_path / 'run'}",
        f"checkpoint_io.dir={tmp_path / 'checkpoints'}",
        *extra,
    ]
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    summary = run_training(load_config(ROOT / "configs/tiny.toml", overrides), console=console)
    return summary, out.getvalue()


@pytest.mark.timeout(300)
def test_records_hold_every_step_once_with_validation(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    # The first attempt saves at step 4 only, then "fails" after step 6 (no final save): the
    # second resumes at 4, does steps 5–8 (5 and 6 again) and must replace their records.
    first, first_output = _train(
        tmp_path, 6, "checkpoint_io.every=4", "checkpoint_io.save_final=false"
    )
    second, output = _train(tmp_path, 8, "checkpoint_io.every=100")
    assert len(first.losses) == 6 and len(second.losses) == 4 and second.first_step == 4

    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert [line["loss"] for line in lines] == [*first.losses[:4], *second.losses]
    for line in lines:
        assert line["tokens"] == 4 * 32 and line["tokens_per_second"] > 0
        assert line["lr"] > 0 and line["grad_norm"] > 0 and line["memory_bytes"] > 0
        assert line["skipped"] is False
    # Validation every 3 steps and after the last, on the held-out split.
    val = {line["step"]: line["val_loss"] for line in lines if line["val_loss"] is not None}
    assert sorted(val) == [3, 6, 8]
    assert val[6] == pytest.approx(second.val_losses[6]) and val[3] == first.val_losses[3]
    assert val[8] < val[3]  # the model learns what it never trained on
    assert "step 6/8 validation loss" in output and "validation loss" in first_output

    # TensorBoard's own reader sees the same figures at every step, the first attempt's steps
    # 5–6 purged by the resume.
    events = event_accumulator.EventAccumulator(str(tmp_path / "run/tensorboard"))
    events.Reload()
    tb_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))  # each once
    for line in lines:
        assert tb_loss[line["step"]] == pytest.approx(line["loss"], rel=1e-6)
    for tag in ("train/lr", "train/grad_norm", "train/tokens_per_second", "train/mfu"):
        assert [e.step for e in events.Scalars(tag)] == list(range(1, 9)), tag
    tb_val = {e.step: e.value for e in events.Scalars("val/loss")}
    assert tb_val == pytest.approx(val)

    # The summary: mean losses, and the whole run's throughput across the restart.
    assert "done: loss" in output and "(mean of steps 5–6 → 7–8)" in output
    assert second.run_steps == 8 and second.run_tokens == 8 * 4 * 32
    assert second.run_seconds == pytest.approx(sum(line["step_seconds"] for line in lines))
    assert "whole run (8 steps across restarts)" in output
    # Log lines every train.log_every steps, plus the first of the attempt and the last.
    assert _logged_steps(first_output) == [1, 4, 6] and _logged_steps(output) == [5, 8]


def _logged_steps(output: str) -> list[int]:
    lines = [x for x in output.splitlines() if x.startswith("step ") and " loss " in x]
    return [int(x.split()[1].split("/")[0]) for x in lines if "validation" not in x]
