"""Jobs plait did not launch, on a real daemon: torchrun runs a user's script with two Gloo ranks
(docs/observe.md's DDP and `Trainer` examples as written, and an FSDP2 script), and the daemon's MFU,
bottleneck split, comm spans, stragglers and hangs are checked against the script's own
figures; `plait stacks`, `plait status` and `plait profile` are run on the DDP job while it is
stuck, `plait memory` on the FSDP2 job. One torchrun launch per test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from plait.core.host import cpu_model, host_cores
from plait.daemon.peak_flops import CpuCalibration, calibration_path
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.doc_blocks import write_files

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
    while_stalled: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[daemon_pb2.CollectiveHang]]:
    """Run `script` on two ranks against `server`; each rank's report, and the hangs the
    daemon showed while the ranks ran (polled every 0.2 s). A stalled rank writes the job's id
    to `release` + ".reached" and waits for `release`, which is created once
    `while_stalled(job)` has returned."""
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
    reached = release.with_name(release.name + ".reached") if release is not None else None
    hangs: list[daemon_pb2.CollectiveHang] = []
    with grpc.insecure_channel(server.address) as channel:
        stub = daemon_pb2_grpc.DaemonStub(channel)
        process = subprocess.Popen(
            command, cwd=script.parent, env=environment,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 360
        try:
            while process.poll() is None and time.monotonic() < deadline:
                hangs.extend(stub.Status(daemon_pb2.StatusRequest(), timeout=30).hangs)
                if reached is not None and reached.exists() and not release.exists():
                    if while_stalled is not None:
                        while_stalled(reached.read_text())
                    # Still stalled: whatever hang the stall makes is shown now.
                    hangs.extend(stub.Status(daemon_pb2.StatusRequest(), timeout=30).hangs)
                    release.touch()
                time.sleep(0.2)
        finally:
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


def cli(*args: str) -> tuple[int, str]:
    from plait.tools.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def cli_process(*args: str) -> subprocess.Popen[str]:
    """The CLI run as an operator runs it, in a process of its own (it waits for the ranks)."""
    return subprocess.Popen(
        [sys.executable, "-m", "plait.tools.cli", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def answer_of(process: subprocess.Popen[str] | None) -> dict[str, Any]:
    assert process is not None
    output, errors = process.communicate(timeout=180)
    assert process.returncode == 0, (output, errors[-4000:])
    return json.loads(output)


def wait_until_both_ranks_hold_an_order(
    server: DaemonServer, job: str, process: subprocess.Popen[str], *, started: bool
) -> None:
    """Until both ranks' polls acknowledge an order: a profile's start step ("request:plan",
    plan >= 1: `started`) or a memory order ("request:0"). From then on each rank acts on it at
    a step boundary, which the stall keeps ahead of them."""
    deadline = time.monotonic() + 180
    while True:
        views = server.control.endpoints(job, time.time_ns())
        holding = {v.hello.rank for v in views
                   if any(ack.endswith(":0") != started for ack in v.hello.busy)}  # fmt: skip
        if holding == {0, 1}:
            return
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the ranks never acknowledged the order"
        time.sleep(0.1)


class WhileStuck:
    """What the DDP test asks of the job while rank 1 is stalled in its second forward (step 1)
    and rank 0 waits for it in the gradient all-reduce: every rank's stacks (`plait stacks`),
    the hang with them (`plait status`), and a 2-step profile (`plait profile`) whose start
    step both ranks hold before they go on."""

    STALLED_STEP = 1

    def __init__(self, server: DaemonServer, trace: Path) -> None:
        self.server, self.trace = server, trace
        self.stacks: dict[int, dict[str, Any]] = {}
        self.status: dict[str, Any] = {}
        self.profile: subprocess.Popen[str] | None = None

    def __call__(self, job: str) -> None:
        host = ("--host", self.server.address)
        # Rank 1 is in its stall (it said so). Rank 0 is stuck once it is in the stalled step
        # with a collective in flight: the step's gradient buckets cannot finish without rank
        # 1 (rank 0's step is read before its ops, and step 0's ops all finished before step 1
        # began). The stacks are then read once more, of two ranks that cannot move.
        deadline = time.monotonic() + 120
        while not self._rank0_waits_in_the_stalled_step(self._stacks(job, host)):
            assert time.monotonic() < deadline, "rank 0 never waited in the stalled step"
        self.stacks = self._stacks(job, host)
        # The daemon shows the hang once rank 0 has waited its hang timeout.
        while True:
            code, printed = cli("status", "--json", *host)
            assert code == 0, printed
            self.status = json.loads(printed)
            if self.status["hangs"]:
                break
            assert time.monotonic() < deadline, "the daemon never showed the hang"
            time.sleep(0.2)
        self.profile = cli_process("profile", "--job", job, "--steps", "2", "-o",
                                   str(self.trace), *host, "--json")  # fmt: skip
        wait_until_both_ranks_hold_an_order(self.server, job, self.profile, started=True)

    def _stacks(self, job: str, host: tuple[str, str]) -> dict[int, dict[str, Any]]:
        code, printed = cli("stacks", "--job", job, "--json", *host)
        assert code == 0, printed
        return {r["rank"]: r for r in json.loads(printed)["ranks"]}

    def _rank0_waits_in_the_stalled_step(self, stacks: dict[int, dict[str, Any]]) -> bool:
        waiting = stacks.get(0)
        return bool(waiting and waiting["step"] == self.STALLED_STEP and waiting["in_flight"])


class MemoryWhileStalled:
    """`plait memory` asked once both ranks are in step 1, where rank 1 stalls (rank 0 cannot
    finish the step without it): both hold the order before they go on, and meter step 2."""

    def __init__(self, server: DaemonServer, output: Path) -> None:
        self.server, self.output = server, output
        self.memory: subprocess.Popen[str] | None = None

    def __call__(self, job: str) -> None:
        deadline = time.monotonic() + 120
        while self._steps(job) != {0: 1, 1: 1}:
            assert time.monotonic() < deadline, "the ranks never polled from step 1"
            time.sleep(0.1)
        self.memory = cli_process("memory", "--job", job, "-o", str(self.output), "--wait",
                                  "120", "--host", self.server.address, "--json")  # fmt: skip
        wait_until_both_ranks_hold_an_order(self.server, job, self.memory, started=False)

    def _steps(self, job: str) -> dict[int, int]:
        """Each rank's step, as its last poll said."""
        return {
            v.hello.rank: v.hello.step for v in self.server.control.endpoints(job, time.time_ns())
        }


def training_frames(stacks: dict[str, Any]) -> list[dict[str, Any]]:
    (thread,) = [t for t in stacks["threads"] if t["training"]]
    return thread["frames"]


@pytest.mark.dist
@pytest.mark.timeout(480)
def test_a_plain_ddp_script_is_observed_like_a_plait_job(tmp_path: Path) -> None:
    """docs/observe.md's DDP example as written; rank 1's forwards take 10× as long, and its second
    one stalls until rank 0 waits for it in the gradient all-reduce, the stacks of both ranks
    have been read, the daemon has shown the hang and a profile's start step is set."""
    (script,) = [p for p in write_files(tmp_path) if p.name == "train_ddp.py"]
    server = DaemonServer("127.0.0.1:0", host_interval=0.5, hang_timeout=1.0).start()
    stuck = WhileStuck(server, tmp_path / "t.json")
    try:
        release = tmp_path / "release"
        reports, hangs = torchrun(script, tmp_path / "out", server, env={
            "OBSERVED_SLOW_RANK": "1", "OBSERVED_SLOW_FACTOR": "9",
            "OBSERVED_STALL_RANK": "1", "OBSERVED_STALL_CALL": "1",
            "OBSERVED_STALL_UNTIL": str(release),
        }, release=release, while_stalled=stuck)  # fmt: skip
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            breakdown = check_mfu_and_breakdown(stub, reports)
            job = reports[0]["job_id"]
            assert dict(stub.Status(daemon_pb2.StatusRequest()).job_states) == {job: "finished"}
        for rank in breakdown.ranks:
            assert dict(rank.comm_ops_by_purpose) == {"grad_bucket": "all_reduce"}
        # The hang: rank 0 in a bucket's all-reduce of step 1, rank 1 not there yet.
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
        # One torchrun agent: one node, so every byte of the buckets' all-reduce stays inside.
        rows = [r for r in json.loads(top.stdout)["ranks"] if r["job_id"] == job]
        assert len(rows) == 2
        for row in rows:
            assert row["comm_bytes_per_step"]["intra_node"] > 0, row
            assert row["comm_bytes_per_step"]["inter_node"] == 0, row
        check_stacks_of_the_stuck_job(stuck)
        check_profile_of_the_observed_job(answer_of(stuck.profile), stuck.trace)
    finally:
        stop(stuck.profile)
        server.stop(grace=0.5)


def stop(process: subprocess.Popen[str] | None) -> None:
    if process is not None and process.poll() is None:
        process.kill()
        process.communicate()


def check_stacks_of_the_stuck_job(stuck: WhileStuck) -> None:
    """Rank 0 in its loop's `loss.backward()`, inside the bucket's all-reduce; rank 1 in the
    user code that stalls its forward; `plait status` shows the hang with both stacks."""
    assert sorted(stuck.stacks) == [0, 1]
    assert [stuck.stacks[r]["step"] for r in (0, 1)] == [stuck.STALLED_STEP] * 2
    waiting = training_frames(stuck.stacks[0])
    assert any(f["file"].endswith("train_ddp.py") and f["code"] == "loss.backward()"
               for f in waiting), waiting  # fmt: skip
    assert any(f["function"] == "_engine_run_backward" for f in waiting), waiting
    (bucket,) = stuck.stacks[0]["in_flight"][:1]
    assert bucket.startswith("all_reduce seq ") and "on world [0, 1] (grad_bucket)" in bucket
    stalled = training_frames(stuck.stacks[1])
    assert any(f["file"].endswith("launch.py") and f["function"] == "stall_until_released"
               for f in stalled), stalled  # fmt: skip
    assert stuck.stacks[1]["in_flight"] == []
    shown = {(h["op"], h["purpose"], tuple(h["entered_ranks"]), tuple(h["missing_ranks"]))
             for h in stuck.status["hangs"]}  # fmt: skip
    assert shown == {("all_reduce", "grad_bucket", (0,), (1,))}, stuck.status["hangs"]
    assert sorted(s["rank"] for s in stuck.status["hang_stacks"]) == [0, 1]


def check_profile_of_the_observed_job(answer: dict[str, Any], trace: Path) -> None:
    """Both ranks, torch's operators, the observer's step, phase and comm spans, the same two
    steps on both ranks, each step's operators inside the observer's span of that step."""
    start = answer["start_step"]
    document = json.loads(trace.read_text())
    processes = document["otherData"]["processes"]
    assert sorted(p["rank"] for p in processes.values()) == [0, 1]
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    for pid, process in processes.items():
        own = [e for e in events if e["pid"] == int(pid)]
        annotated = sorted(e["name"] for e in own if e["name"].startswith("ProfilerStep#"))
        assert annotated == [f"ProfilerStep#{start}", f"ProfilerStep#{start + 1}"], process
        steps = {e["args"]["plait.step"]: e for e in own if e["cat"] == "plait.step"}
        assert sorted(steps) == [start, start + 1], process
        assert any(e["name"].startswith("aten::") and e["cat"] == "cpu_op" for e in own)
        phases = {e["name"] for e in own if e["cat"] in ("plait.phase", "plait.data")}
        assert {"data", "forward", "backward", "optimizer"} <= phases, phases
        assert {e["name"] for e in own if e["cat"] == "plait.comm"} == {"all_reduce"}
        for annotation in (e for e in own if e["name"].startswith("ProfilerStep#")):
            span = steps[int(annotation["name"].split("#")[1])]
            inside = [e for e in own if e["cat"] == "cpu_op" and e["tid"] == annotation["tid"]
                      and annotation["ts"] <= e["ts"]
                      and e["ts"] + e["dur"] <= annotation["ts"] + annotation["dur"]]  # fmt: skip
            assert inside
            first = min(e["ts"] for e in inside)
            last = max(e["ts"] + e["dur"] for e in inside)
            assert span["ts"] - 1000 <= first and last <= span["ts"] + span["dur"] + 1000
    assert sorted(r["rank"] for r in answer["analysis"]["ranks"]) == [0, 1]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_an_fsdp2_script_shows_its_all_gathers_and_reduce_scatters(tmp_path: Path) -> None:
    """An FSDP2 script; `plait memory` is asked while rank 1 stalls in its second forward."""
    script = tmp_path / "train_fsdp.py"
    script.write_text((LAUNCH.parent / "train_fsdp.py").read_text())
    server = DaemonServer("127.0.0.1:0", host_interval=0.5).start()
    stalled = MemoryWhileStalled(server, tmp_path / "memory")
    try:
        release = tmp_path / "release"
        reports, _ = torchrun(script, tmp_path / "out", server, env={
            "OBSERVED_STALL_RANK": "1", "OBSERVED_STALL_CALL": "1",
            "OBSERVED_STALL_UNTIL": str(release),
        }, release=release, while_stalled=stalled)  # fmt: skip
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
        check_memory_of_the_sharded_job(answer_of(stalled.memory), reports[0])
    finally:
        stop(stalled.memory)
        server.stop(grace=0.5)


def check_memory_of_the_sharded_job(answer: dict[str, Any], report: dict[str, Any]) -> None:
    """Each rank metered step 2 (the first it started after the order) and holds half of the
    model's parameters (every parameter's first dimension is even: no padding) and AdamW's two
    moments of its half; the step's gradients are freed by its `zero_grad()`."""
    assert sorted(Path(f).name for f in answer["files"]) == [
        "rank0.memory.json",
        "rank1.memory.json",
    ]
    assert [r["rank"] for r in answer["ranks"]] == [0, 1]
    for memory in answer["ranks"]:
        assert memory["step"] == 2 and memory["note"] == "", memory
        state = memory["model_state"]
        assert state["parameters"] == report["parameter_bytes"] // 2, (state, report)
        assert state["optimizer_state"] == 2 * state["parameters"], state
        assert state["gradients"] == 0 and state["total"] == 3 * state["parameters"], state
        assert memory["activations_saved_bytes"] > 0 and memory["rss_bytes"] > 0, memory


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_transformers_trainer_with_the_callback(tmp_path: Path) -> None:
    """docs/observe.md's `Trainer` example as written: a tiny Llama from a config on two ranks."""
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
    from plait.testing.distributed import run_distributed
    from tests.dist.observed.workers import user_comm_hook

    with DaemonServer("127.0.0.1:0", host_interval=0.5) as server:
        results = run_distributed(user_comm_hook, 2, server.address, timeout=90)
    for result in results:
        assert "already has a comm hook" in result["refused"]
        # Summed, not averaged: the inputs are 1 and 2 on the two ranks.
        assert result["grad"] == pytest.approx(3.0)
        assert result["timed"] == [("all_reduce", "grad_bucket", True)]
        # DDP's default without a user's hook: averaged (the inputs' mean, 1.5), timed too.
        assert result["default_grad"] == pytest.approx(1.5)
        assert result["default_timed"] == [("all_reduce", "grad_bucket", True)]
