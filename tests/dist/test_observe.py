"""Jobs plait did not launch, on a real daemon: torchrun runs a user's script with two Gloo ranks
(the README's DDP and `Trainer` examples as written, and an FSDP2 script), and the daemon's MFU,
bottleneck split, comm spans, stragglers and hangs are checked against the script's own
figures. One torchrun launch per test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from plait.core.peak_flops import CpuCalibration, calibration_path, cpu_model, host_cores
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.readme_blocks import write_files

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(__file__).with_name("observed") / "launch.py"
STEP_LINE = re.compile(r"rank (\d+) step (\d+) loss \S+ step_ms ([\d.]+)")
CLASSES = ("compute", "exposed_comm", "data_wait", "pipeline_bubble", "optimizer", "host_other")
HOST_PEAK = 1e12  # FLOP/s, the host's (each of two ranks: half)
STEPS = 20
WINDOW = STEPS - 3  # leaves out the counted first step and the stalled second one


def torchrun(
    script: Path,
    out: Path,
    server: DaemonServer,
    env: dict[str, str] | None = None,
    release: Path | None = None,
) -> tuple[list[dict[str, Any]], list[daemon_pb2.CollectiveHang]]:
    """Run `script` on two ranks against `server`; each rank's report, and the hangs the
    daemon showed while the ranks ran (polled every 0.2 s). `release` is created once a hang
    has been seen (a stalled rank waits for it)."""
    out.mkdir()
    cache = out / "cache"
    cache.mkdir()
    # A settled calibration, so the peak is the same on every machine and far above what two
    # single-threaded ranks reach (MFU a few %): a quiet host never reads "calibration error".
    calibration = CpuCalibration(
        flops=HOST_PEAK, dtype="float32", probe_flops={"float32": HOST_PEAK},
        cpu_model=cpu_model(), cores=host_cores(), gemm_size=1024, seconds=1.0,
        measured_at=time.time(), measured_by="test", cpu_share=1.0,
    )  # fmt: skip
    (cache / calibration_path().name).write_text(json.dumps(asdict(calibration)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(LAUNCH), str(script), str(out)]  # fmt: skip
    environment = {
        **os.environ,
        "PLAIT_DAEMON": server.address,
        "PLAIT_HEARTBEAT_INTERVAL_MS": "200",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PLAIT_CACHE_DIR": str(cache),
        **(env or {}),
    }
    hangs: list[daemon_pb2.CollectiveHang] = []
    with grpc.insecure_channel(server.address) as channel:
        stub = daemon_pb2_grpc.DaemonStub(channel)
        process = subprocess.Popen(
            command, cwd=script.parent, env=environment,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while process.poll() is None and time.monotonic() < deadline:
            hangs.extend(stub.Status(daemon_pb2.StatusRequest(), timeout=30).hangs)
            if hangs and release is not None:
                release.touch()
            time.sleep(0.2)
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert process.returncode == 0, output[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], hangs


def step_seconds(report: dict[str, Any]) -> list[float]:
    """The script's own step times, in its step order (its printed lines)."""
    found = {int(m[2]): float(m[3]) / 1e3 for m in map(STEP_LINE.match, report["lines"]) if m}
    return [found[step] for step in sorted(found)]


def check_mfu_and_breakdown(
    stub: daemon_pb2_grpc.DaemonStub, reports: list[dict[str, Any]]
) -> daemon_pb2.GetBottleneckResponse:
    """The daemon's MFU against the hand figure, and its classes against the script's steps."""
    job = reports[0]["job_id"]
    assert job and reports[1]["job_id"] == job  # torchrun's rendezvous id names the job
    peaks = {r.rank: r.peak_flops for r in stub.ListRanks(daemon_pb2.ListRanksRequest()).ranks}
    metrics = stub.GetMetrics(daemon_pb2.GetMetricsRequest(job_id=job, window_steps=WINDOW))
    breakdown = stub.GetBottleneck(daemon_pb2.GetBottleneckRequest(job_id=job, window_steps=WINDOW))
    by_rank = {m.rank: m for m in metrics.ranks}
    assert sorted(by_rank) == [0, 1] and [j.step for j in metrics.jobs] == [STEPS]
    for report in reports:
        rank, seconds = report["rank"], step_seconds(report)[-WINDOW:]
        assert len(seconds) == WINDOW
        # 6·N·tokens: every Linear weight, forward (2) and backward (4), this rank's tokens.
        flops = 6 * report["dense_weights"] * report["batch_size"] * report["seq_len"]
        hand = flops / (sum(seconds) / WINDOW) / peaks[rank]
        assert peaks[rank] == HOST_PEAK / 2 and by_rank[rank].mfu == pytest.approx(
            hand, rel=0.05
        ), rank
        (mine,) = [b for b in breakdown.ranks if b.rank == rank]
        parts = sum(getattr(mine, f"{name}_seconds") for name in CLASSES)
        assert parts == pytest.approx(sum(seconds) / WINDOW, rel=0.02), (rank, mine)
        assert mine.compute_seconds > 0 and mine.optimizer_seconds > 0
        assert mine.comm_seconds > 0 and mine.exposed_comm_seconds <= mine.comm_seconds + 1e-9
    return breakdown


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_plain_ddp_script_is_observed_like_a_plait_job(tmp_path: Path) -> None:
    """The README's DDP example as written; rank 1's forwards take 10× as long, and its second
    one stalls until the daemon has shown rank 0 waiting for it in the gradient all-reduce."""
    (script,) = [p for p in write_files(tmp_path) if p.name == "train_ddp.py"]
    server = DaemonServer("127.0.0.1:0", host_interval=0.5, hang_timeout=1.0).start()
    try:
        release = tmp_path / "hang-seen"
        reports, hangs = torchrun(script, tmp_path / "out", server, env={
            "OBSERVED_SLOW_RANK": "1", "OBSERVED_SLOW_FACTOR": "9",
            "OBSERVED_STALL_RANK": "1", "OBSERVED_STALL_CALL": "1",
            "OBSERVED_STALL_UNTIL": str(release),
        }, release=release)  # fmt: skip
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            breakdown = check_mfu_and_breakdown(stub, reports)
            job = reports[0]["job_id"]
            assert dict(stub.Status(daemon_pb2.StatusRequest()).job_states) == {job: "finished"}
        for rank in breakdown.ranks:
            assert dict(rank.comm_ops_by_purpose) == {"grad_bucket": "all_reduce"}
        # The hang: rank 0 in a bucket's all-reduce of step 2, rank 1 not there yet.
        ours = [h for h in hangs if h.job_id == job]
        assert ours, "no hang shown while rank 1 stalled"
        assert {(h.group, h.op, h.purpose) for h in ours} == {
            ("world", "all_reduce", "grad_bucket")
        }
        assert all(list(h.missing_ranks) == [1] and list(h.entered_ranks) == [0] for h in ours)
        # The straggler: rank 1's forward takes 10× as long every step (flagged while its
        # backward takes under 17× its own forward, whatever the machine's load).
        flagged = {s.rank: s.flagged for s in breakdown.stragglers}
        assert flagged == {0: False, 1: True}, breakdown.stragglers
        # The CLI shows the job as it shows plait's.
        from plait.tools.cli import app

        result = CliRunner().invoke(
            app, ["bottleneck", "--json", "--all", "--host", server.address]
        )
        assert result.exit_code == 0, result.output
        assert job in result.output and "grad_bucket" in result.output
        top = CliRunner().invoke(app, ["top", "--json", "--all", "--host", server.address])
        assert top.exit_code == 0 and job in top.output, top.output
    finally:
        server.stop(grace=0.5)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_an_fsdp2_script_shows_its_all_gathers_and_reduce_scatters(tmp_path: Path) -> None:
    script = tmp_path / "train_fsdp.py"
    script.write_text((LAUNCH.parent / "train_fsdp.py").read_text())
    server = DaemonServer("127.0.0.1:0", host_interval=0.5).start()
    try:
        reports, _ = torchrun(script, tmp_path / "out", server)
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            breakdown = check_mfu_and_breakdown(stub, reports)
            trace = stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(job_id=reports[0]["job_id"]))
        for rank in breakdown.ranks:
            ops = dict(rank.comm_ops_by_purpose)
            assert ops == {"param_gather": "all_gather", "grad_bucket": "reduce_scatter"}, ops
            # The loader's 20 ms (at least), outside the `with`, are the step's data phase.
            assert rank.data_wait_seconds >= 0.019, rank
        names = {e.get("name") for e in json.loads(trace.chrome_trace_json)["traceEvents"]}
        assert {"all_gather", "reduce_scatter", "forward", "backward", "optimizer"} <= names
    finally:
        server.stop(grace=0.5)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_transformers_trainer_with_the_callback(tmp_path: Path) -> None:
    """The README's `Trainer` example as written: a tiny Llama from a config on two ranks."""
    pytest.importorskip("accelerate")
    (script,) = [p for p in write_files(tmp_path) if p.name == "train_hf.py"]
    server = DaemonServer("127.0.0.1:0", host_interval=0.5).start()
    try:
        reports, _ = torchrun(script, tmp_path / "out", server)
        job = reports[0]["job_id"]
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            metrics = stub.GetMetrics(daemon_pb2.GetMetricsRequest(job_id=job))
            breakdown = stub.GetBottleneck(daemon_pb2.GetBottleneckRequest(job_id=job))
        (job_metrics,) = metrics.jobs
        global_step = reports[0]["global_step"]
        assert global_step == 6 and job_metrics.step == global_step
        assert job_metrics.mfu > 0 and job_metrics.state == "finished"
        logged = [entry["loss"] for entry in reports[0]["log_history"] if "loss" in entry]
        assert len(logged) == global_step
        for rank in metrics.ranks:
            assert rank.step == global_step
            assert rank.loss == pytest.approx(logged[-1], rel=1e-6)  # the loss the trainer logs
        for rank in breakdown.ranks:  # DDP's buckets, found inside the trainer's wrapper
            assert dict(rank.comm_ops_by_purpose) == {"grad_bucket": "all_reduce"}
            assert rank.compute_seconds > 0 and rank.optimizer_seconds > 0
    finally:
        server.stop(grace=0.5)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_lightning_run_with_the_callback(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    script = tmp_path / "train_lightning.py"
    script.write_text((LAUNCH.parent / "train_lightning.py").read_text())
    server = DaemonServer("127.0.0.1:0", host_interval=0.5).start()
    try:
        reports, _ = torchrun(script, tmp_path / "out", server)
        job = reports[0]["job_id"]
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            metrics = stub.GetMetrics(daemon_pb2.GetMetricsRequest(job_id=job))
            breakdown = stub.GetBottleneck(daemon_pb2.GetBottleneckRequest(job_id=job))
        (job_metrics,) = metrics.jobs
        assert reports[0]["global_step"] == 5 and job_metrics.step == 5
        assert job_metrics.mfu > 0 and job_metrics.state == "finished"
        for rank in metrics.ranks:  # each rank's own loss of its last step
            own = reports[rank.rank]["metrics"]["train_loss"]
            assert rank.step == 5 and rank.loss == pytest.approx(own, rel=1e-6)
        for rank in breakdown.ranks:
            assert dict(rank.comm_ops_by_purpose) == {"grad_bucket": "all_reduce"}
            assert rank.compute_seconds > 0 and rank.optimizer_seconds > 0
            assert rank.comm_seconds > 0 and rank.exposed_comm_seconds <= rank.comm_seconds
    finally:
        server.stop(grace=0.5)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_users_comm_hook_runs_inside_the_timing_hook() -> None:
    from plait.core.testing import run_distributed
    from tests.dist.observed.workers import user_comm_hook

    with DaemonServer("127.0.0.1:0", host_interval=0.5) as server:
        results = run_distributed(user_comm_hook, 2, server.address, timeout=90)
    for result in results:
        assert "already has a comm hook" in result["refused"]
        # Summed, not averaged: the inputs are 1 and 2 on the two ranks.
        assert result["grad"] == pytest.approx(3.0)
        assert result["timed"] == [("all_reduce", "grad_bucket", True)]
