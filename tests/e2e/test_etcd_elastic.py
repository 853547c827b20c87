"""An elastic job on an etcd rendezvous loses a node and goes on without it.

Two `plait train` agents (one rank each, `--nnodes 1:2`) meet through an etcd server on
loopback — no agent hosts the rendezvous, so none is a single point of failure. After step 5
rank 0 kills its own node (its agent, then itself: a machine lost, nothing left to restart it).
The surviving agent's rank fails in its next collective, torchrun restarts it, the rendezvous
closes with one node, and the run resumes from the last checkpoint as world 1 (dp 2 → 1) and
finishes with the losses of an uninterrupted two-rank run.

etcd comes from the system (`etcd-server` on Debian, which `make test` installs where apt is
available) and `python-etcd` (the dev extra); the test says which is missing when it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.free_ports import unassigned_port

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_AFTER = 8, 2, 5
SETTINGS = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "telemetry.enabled=false",
    "data.seq_len=32",
    f"checkpoint_io.every={EVERY}",
]
# Survivors wait `last_call_timeout` for late joiners, and a node silent for
# keep_alive_interval × keep_alive_max_attempt seconds is dead to the rendezvous.
RDZV_CONF = "join_timeout=120,last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=3"


@pytest.fixture
def etcd_endpoint(tmp_path: Path):
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd server on PATH (Debian: apt-get install etcd-server)")
    pytest.importorskip("etcd", reason="torchrun's etcd-v2 rendezvous needs python-etcd")
    client, peer = unassigned_port(), unassigned_port()
    command = [
        binary,
        "--data-dir", str(tmp_path / "etcd"),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--enable-v2=true",  # torchrun's etcd rendezvous speaks the v2 API
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", client), timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    else:
        server.kill()
        pytest.fail("etcd did not start listening within 30 s")
    yield f"127.0.0.1:{client}"
    server.kill()
    server.wait(timeout=10)


def _launch(extra: list[str], settings: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "plait.tools.cli", "train", "configs/tiny.toml", *extra]
    for item in settings:
        command += ["--set", item]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _losses(run_dir: Path) -> dict[int, float]:
    """The loss of each step in metrics.jsonl (the last record of a step replayed on resume)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in records}


@pytest.mark.dist
@pytest.mark.timeout(420)
def test_losing_any_node_of_an_etcd_job_shrinks_it_and_resumes(
    tmp_path: Path, etcd_endpoint: str
) -> None:
    elastic = [
        "--nproc-per-node", "1", "--nnodes", "1:2", "--max-restarts", "1",
        "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_endpoint,
        "--rdzv-id", f"etcd-test-{os.getpid()}", "--rdzv-conf", RDZV_CONF,
    ]  # fmt: skip
    lost = [
        *SETTINGS,
        f"checkpoint_io.dir={tmp_path / 'ckpt'}",
        f"train.run_dir={tmp_path / 'run'}",
        f"checkpoint_io.fault_injection.kill_after_step={KILL_AFTER}",
        "checkpoint_io.fault_injection.rank=0",
        "checkpoint_io.fault_injection.scope=node",
        # The node dies a step after a save, which must be on disk by then (an asynchronous
        # save, the default, may still be writing).
        "checkpoint_io.async_save=false",
    ]
    agents = [_launch(elastic, lost) for _ in range(2)]
    # The uninterrupted two-rank run to compare with, meanwhile (its own rendezvous).
    straight = _launch(
        ["--nproc-per-node", "2"],
        [
            *SETTINGS,
            f"checkpoint_io.dir={tmp_path / 'straight'}",
            f"train.run_dir={tmp_path / 's'}",
        ],
    )
    outputs, codes = [], []
    for agent in agents:
        outputs.append(agent.communicate(timeout=360)[0])
        codes.append(agent.returncode)
    report = "\n---\n".join(outputs)
    # The node of rank 0 died (SIGKILL: -9); the other finished the run alone.
    assert sorted(codes) == [-9, 0], (codes, report)
    assert f"rank 0 kills its node after step {KILL_AFTER}" in report, report
    survivor = outputs[codes.index(0)]
    last_saved = KILL_AFTER // EVERY * EVERY
    resumed = f"resumed from {tmp_path / 'ckpt'}/step-{last_saved:08d} at step {last_saved}"
    assert resumed in survivor, survivor
    assert "1 rank (pp=1 dp=1" in survivor, survivor
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{STEPS:08d}"
    out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, out
    expected, got = _losses(tmp_path / "s"), _losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1)), got
    # dp 2 → 1 over the same global batches: only the summation order differs.
    assert [got[s] for s in sorted(got)] == pytest.approx(
        [expected[s] for s in sorted(expected)], rel=1e-5, abs=1e-5
    )
