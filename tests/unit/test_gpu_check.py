"""tools/gpu_check.py: its pieces, and the whole rehearsal (every stage, tiny, on this CPU), so
the run a GPU node gets for a few minutes cannot rot between those minutes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.tools import gpu_check, gpu_check_training

ROOT = Path(__file__).resolve().parents[2]

SAMPLE_TESTS = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("no GPU here")

def test_errors(broken):
    pass
"""


def test_each_outcome_is_written_as_the_test_ends(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    outcomes = tmp_path / "outcomes.jsonl"
    env = {"PLAIT_TEST_OUTCOMES": str(outcomes), "PATH": "/usr/bin:/bin"}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "plait.tools.pytest_outcomes", "test_sample.py"],
        cwd=tmp_path, env=env, capture_output=True, check=False, timeout=120,
    )  # fmt: skip
    found = {line["test"].split("::")[-1]: line for line in gpu_check.read_test_outcomes(outcomes)}
    assert {name: line["outcome"] for name, line in found.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
        "test_errors": "error",
    }
    assert "one is not two" in found["test_fails"]["reason"]
    assert found["test_skips"]["reason"] == "Skipped: no GPU here"
    assert "fixture broke" in found["test_errors"]["reason"]


def test_a_line_cut_by_a_kill_is_dropped(tmp_path: Path) -> None:
    outcomes = tmp_path / "outcomes.jsonl"
    outcomes.write_text('{"test": "a", "outcome": "passed"}\n{"test": "b", "outc')
    assert gpu_check.read_test_outcomes(outcomes) == [{"test": "a", "outcome": "passed"}]
    assert gpu_check.read_test_outcomes(tmp_path / "absent.jsonl") == []


def test_a_stage_past_its_cap_loses_its_whole_process_group(tmp_path: Path) -> None:
    check = gpu_check.Check(out=tmp_path, deadline=time.monotonic() + 60, rehearse=True,
                            wheelhouse=None)  # fmt: skip
    # A shell that starts a grandchild and waits: both must go when the cap passes.
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    process = gpu_check.start(check, ["bash", "-c", script], "stage")
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert process.poll() is None
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert gpu_check.finish(process, time.monotonic()) is None  # the cap has passed
    assert process.returncode is not None
    # The signal is sent to the group at once; the grandchild dies when it next runs.
    deadline = time.monotonic() + 30
    while Path(f"/proc/{grandchild}").exists() and not _is_zombie(grandchild):
        assert time.monotonic() < deadline, "the grandchild outlived its stage's cap"
        time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_the_eight_rank_run_ends_midway_through_the_cpu_stage() -> None:
    check = gpu_check.Check(out=Path("."), deadline=time.monotonic() + 100, rehearse=True,
                            wheelhouse=None)  # fmt: skip
    stages = [s for s in gpu_check.STAGES if s.name != "environment"]
    shares = {s.name: s.share for s in stages}
    ends = gpu_check.background_deadline(check, stages) - time.monotonic()
    expected = (sum(shares.values()) - shares["profile"] - shares["cpu"] / 2) / sum(shares.values())
    assert ends == pytest.approx(100 * expected, abs=1.0)


def test_kernel_rows_become_ratios_against_torch_compile() -> None:
    rows = [
        {"op": "rms_norm", "shape": "8×4", "pass_": "fwd", "provider": "torch", "ms": 4.0},
        {"op": "rms_norm", "shape": "8×4", "pass_": "fwd", "provider": "torch.compile", "ms": 1.0},
        {"op": "rms_norm", "shape": "8×4", "pass_": "fwd", "provider": "triton", "ms": 2.0},
        {"op": "rope", "shape": "2", "pass_": "fwd", "provider": "triton", "error": "boom"},
    ]
    by_op = {entry["op"]: entry for entry in gpu_check.kernel_ratios(rows)}
    assert by_op["rms_norm"]["triton_vs_compile"] == 0.5
    assert by_op["rope"] == {"op": "rope", "shape": "2", "pass": "fwd", "triton": "boom"}


def test_the_compile_bench_gives_each_layout_a_rank_per_device() -> None:
    from plait.tools.bench.compile import plan

    layouts = ["zero3", "tp+sp", "cp", "ddp"]
    one_gpu = plan(layouts, 2, 1)
    assert {name: row["ranks"] for name, row in one_gpu.items()} == {
        "zero3": 1, "tp+sp": 0, "cp": 0, "ddp": 1,
    }  # fmt: skip
    assert one_gpu["cp"]["skipped"].endswith("1 device here") and not one_gpu["ddp"]["skipped"]
    assert all(row == {"ranks": 2, "skipped": None} for row in plan(layouts, 2, 8).values())
    assert plan(layouts, 2, None) == plan(layouts, 2, 2)  # Gloo ranks: no device limit


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_rehearsal_runs_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "check"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--rehearse", "--out", str(out),
         "--budget-seconds", "800"],
        cwd=tmp_path, check=True, timeout=880, capture_output=True,
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == [s.name for s in gpu_check.STAGES]
    for name in ("environment", "gpu_tier", "bench", "fp8", "compile", "training", "cpu"):
        assert stages[name]["status"] == "passed", (name, stages[name])
    assert stages["environment"]["plait"] not in ("", None)
    tier = stages["gpu_tier"]
    assert tier["counts"].get("skipped", 0) == len(tier["tests"]) > 30  # no GPU: all skip
    assert all("CUDA" in case["reason"] for case in tier["tests"])
    assert {"plain eager", "plait torch"} <= set(stages["bench"]["model"]["variants"])
    fp8 = stages["fp8"]["figures"]["variants"]
    assert set(fp8) == {"bf16", "plait fp8", "torchao fp8"}
    assert all(len(row["losses"]) == 2 for row in fp8.values())
    # The compile bench planned as on a one-GPU node: ZeRO-3 compiled vs eager on one rank,
    # joined through the environment rendezvous as on the node; tp + sp skipped, saying why
    # (the figures come from the bench's JSON).
    compiled = stages["compile"]
    assert compiled["status"] == "passed", compiled
    zero3, tp = compiled["layouts"]["zero3"], compiled["layouts"]["tp+sp"]
    assert (zero3["ranks"], zero3["backend"], zero3["rendezvous"]) == (1, "gloo", "environment")
    assert tp["ranks"] == 0 and tp["skipped"] == compiled["skipped"]["tp+sp"]
    assert set(compiled["ratios"]) == {"zero3"}
    assert all(ratio > 0 for ratio in compiled["ratios"]["zero3"].values())
    # Compiled equals eager at both steps (warm-up and timed), with no recompilation.
    equal = compiled["equality"]["zero3"]
    assert equal["steps_compared"] == 2 and equal["recompilations"] == 0, equal
    assert equal["max_loss_difference"] < 1e-4, equal
    assert "1 device here" in compiled["skipped"]["tp+sp"]
    assert set(compiled["medians"]) == {"zero3 eager", "zero3 compiled"}
    assert "1 graph for 1 block" in compiled["watch"]["zero3 compiled"][0]
    training = stages["training"]
    # The stage stops the rank itself once the live views and the capture are in (SIGTERM:
    # the rank finishes its step and exits 143), whatever its pace.
    assert training["stopped_after_views"] and training["train_exit_code"] == 143
    assert training["live_top_ranks"][0]["step"] >= gpu_check_training.LIVE_WINDOW
    assert training["top_ranks"][0]["step"] >= training["live_top_ranks"][0]["step"]
    assert training["bottleneck_ranks"][0]["dominant"]
    # The three views after the run (asked at once) each answered.
    assert training["errors"] == {}, training["errors"]
    job = gpu_check_training.JOB_ID
    assert [(r["job_id"], r["rank"]) for r in training["status_view"]["ranks"]] == [(job, 0)]
    profile = stages["profile"]
    assert profile["status"] == "passed" and profile["trace_bytes"] > 0, profile
    cpu = stages["cpu"]
    assert cpu["eight_ranks"]["counts"] == {"passed": 2}
    assert cpu["daemon_load"]["figures"]["spans_stored_per_second"] > 0
