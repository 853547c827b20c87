"""`plait train` for real: torchrun launches two Gloo ranks that train the tiny Llama."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAIT = [sys.executable, "-m", "plait.tools.cli"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_train_two_ranks_loss_falls() -> None:
    result = _run(
        [
            "train",
            "configs/tiny.toml",
            "--nproc-per-node",
            "2",
            "--set",
            "train.steps=8",
            "--set",
            "telemetry.enabled=false",
        ],
        timeout=220,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks (pp=1 dp=2 cp=1 tp=1)" in result.stdout
    assert "MFU" in result.stdout
    done = re.search(r"done: loss ([\d.]+) → ([\d.]+) \(mean of steps 1–4 → 5–8\)", result.stdout)
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first - 0.2, f"loss did not fall: {first} → {last}"
    # Log lines every 10 steps by default (not a terminal): the first and the last step here.
    assert re.findall(r"^step (\d+)/8 loss", result.stdout, re.MULTILINE) == ["1", "8"]
    assert re.search(r"step 8/8 .* elapsed \d+:\d\d:\d\d eta 0:00:00", result.stdout)
    # The banner names the strategy, schedule, communication algorithm and data source.
    assert "dp strategy ddp (" not in result.stdout  # DDP has no option worth naming here
    assert "schedule accumulate · comm torch" in result.stdout
    assert "data bundled corpus (" in result.stdout and "byte tokenizer" in result.stdout
    assert "OMP_NUM_THREADS" not in result.stdout + result.stderr


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_rank_failure_is_one_line_with_the_full_report_in_the_run_dir(tmp_path: Path) -> None:
    # A token directory that passes the launch checks (it exists) but that no rank can read.
    data = tmp_path / "tokens"
    data.mkdir()
    (data / "meta.json").write_text('{"format": "plait-tokens", "format_version": 7}')
    run_dir = tmp_path / "run"
    result = _run(
        [
            "train",
            "configs/tiny.toml",
            "--nproc-per-node",
            "2",
            "--set",
            f"data.path={data}",
            "--set",
            "telemetry.enabled=false",
            "--set",
            f"train.run_dir={run_dir}",
        ],
        timeout=220,
    )
    assert result.returncode == 1
    output = (result.stdout + result.stderr).strip()
    lines = output.splitlines()
    assert len(lines) == 1, output
    assert re.fullmatch(
        rf"training failed: rank [01] failed: {re.escape(str(data / 'meta.json'))}: "
        r"format_version 7 is not supported .*; rank [01] alike "
        rf"\(full report: {re.escape(str(run_dir / 'launch.log'))}\)",
        lines[0],
    ), lines[0]
    report = (run_dir / "launch.log").read_text()
    assert "plait.tools.trainer FAILED" in report  # torchrun's own report
    assert report.count("Traceback (most recent call last)") >= 2  # every rank's traceback
    assert "TokenFileError" in report


def test_dry_run_prints_the_mesh_and_estimates_without_launching() -> None:
    result = _run(
        [
            "train",
            "configs/tiny.toml",
            "--nproc-per-node",
            "4",
            "--dry-run",
            "--set",
            "model.size=1b",  # built on the meta device: nothing is allocated
            "--set",
            "parallel.tp=2",
            "--set",
            "parallel.dp_strategy=zero2",
        ],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "dry run: llama/1b · 1,100,048,384 parameters · 4 ranks (pp=1 dp=2 cp=1 tp=2)" in out
    assert "dp groups: [0, 2] [1, 3]" in out and "tp groups: [0, 1] [2, 3]" in out
    row = re.search(r"│\s+([\d,]+) │\s+([\d,.]+) │\s+([\d,.]+) │\s+([\d,.]+) │", out)
    assert row, out
    params, param_mib, grad_mib, optim_mib = (float(g.replace(",", "")) for g in row.groups())
    # tp=2 halves the parameters (counted on the meta device; the planner's bytes agree);
    # zero2 shards gradients and AdamW's two fp32 moments over dp=2.
    assert params == 1_100_048_384 // 2
    assert param_mib == pytest.approx(params * 4 / 2**20, rel=0.01)
    assert grad_mib == pytest.approx(param_mib / 2, rel=1e-3)
    assert optim_mib == pytest.approx(param_mib, rel=1e-3)
    assert "Nothing was launched" in out and "torch.distributed" not in result.stderr


def test_train_rejects_bad_config_before_launching() -> None:
    result = _run(
        ["train", "configs/tiny.toml", "--set", "parallel.dp_strategy=zero9"], timeout=180
    )
    assert result.returncode == 2
    assert "zero9" in result.stdout and "ddp" in result.stdout
    assert "torch.distributed" not in result.stderr  # nothing was launched


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_demo_runs_with_the_daemon_from_any_folder_and_logs_to_a_file(tmp_path: Path) -> None:
    # As under Slurm: stdout is a file, no COLUMNS, and the working folder holds nothing.
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PLAIT_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    (tmp_path / "work").mkdir()
    log = tmp_path / "demo.log"
    with log.open("w") as out:
        code = subprocess.run(
            [*PLAIT, "demo", "--steps", "10"], stdout=out, stderr=subprocess.STDOUT,
            cwd=tmp_path / "work", env=env, timeout=220,
        ).returncode  # fmt: skip
    text = log.read_text()
    assert code == 0, text
    assert "node daemon on 127.0.0.1:" in text
    assert "── what the daemon saw ──" in text and "── bottleneck report ──" in text
    # The job table: one line per job, every column whole (`tokens/s`, not `toke`).
    (header,) = [line for line in text.splitlines() if line.startswith("┃ job ")][:1]
    assert all(f" {c} " in header for c in ("job", "ranks", "step", "tokens/s", "MFU", "step ms"))
    assert re.search(r"^│ demo +│ +2/2 │.*\d+\.\d% ", text, re.MULTILINE), text
    # The daemon's live lines (if the run lasted past a poll) are whole: never a figure cut.
    rank = r"rank \d+: step \d+ · [\d,]+ tok/s · MFU \S+"
    for line in text.splitlines():
        if "tok/s" in line and "daemon │" in line:
            assert re.fullmatch(rf"daemon │ {rank}( \| {rank})*", line), line
        assert not re.match(r"^\s*tok/s", line), line
    assert list((tmp_path / "work").iterdir()) == []  # the demo leaves the folder as it was
