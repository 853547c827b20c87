"""Two nodes as an operator starts them: two `plait train` agents on this machine, `--nnodes 2
--node-rank 0|1` with a static rendezvous, 2 ranks each, HSDP (ZeRO-3 sharded inside the node,
replicated across). The ranks learn the host map from torchrun (not from a test's environment),
train as one process does, and the daemon counts the cross-node bytes HSDP's formula gives:
the replicas' gradient all-reduce, 2·(2−1)/2 of the gradient per rank, once per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.daemon.server import DaemonServer
from plait.plugins.models import resolve_model_config
from plait.plugins.models.llama import build_llama
from plait.tools.daemon_commands import app
from tests.free_ports import unassigned_port

PLAIT = [sys.executable, "-m", "plait.tools.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
JOB = "two-agents"
HOST_MAP = "2 × 2 ranks (node0: ranks 0-1"


def _settings(run_dir: str) -> list[str]:
    pairs = {
        "train.steps": STEPS,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 2,
        "train.max_grad_norm": 0.0,
        "train.run_dir": run_dir,
        "parallel.dp_strategy": "zero3",
    }
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


def _env() -> dict[str, str]:
    return dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", OMP_NUM_THREADS="1", COLUMNS="200")


def _losses(run_dir: Path) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def _gradient_bytes() -> int:
    config = resolve_model_config("llama", "tiny", {})
    model = build_llama(config, Kernels(Plugins.create(autoload=False), prefer=["torch"]))
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.dist
@pytest.mark.timeout(420)
def test_two_agents_are_two_nodes_and_hsdp_keeps_the_shards_inside(tmp_path: Path) -> None:
    config = str(ROOT / "configs" / "tiny.toml")
    with DaemonServer("127.0.0.1:0", host_interval=0.2) as daemon:
        command = [
            *PLAIT, "train", config, "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{unassigned_port()}",
            *_settings("hsdp"), "--set", "parallel.dp_shard=node",
            "--set", f"telemetry.daemon={daemon.address}", "--set", f"telemetry.job_id={JOB}",
        ]  # fmt: skip
        agents = [
            subprocess.Popen(
                [*command, "--node-rank", str(node)],
                cwd=tmp_path,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        outputs = []
        try:
            for agent in agents:
                outputs.append(agent.communicate(timeout=300)[0])
        finally:
            for agent in agents:
                agent.kill()
        for agent, output in zip(agents, outputs, strict=True):
            assert agent.returncode == 0, output
        # Rank 0 (on the node-rank 0 agent) prints the banner: the host map torchrun gave.
        assert HOST_MAP in " ".join(outputs[0].split()), outputs[0]

        top = CliRunner().invoke(
            app, ["top", "--json", "--host", daemon.address, "--job", JOB,
                  "--window-steps", str(STEPS)],
        )  # fmt: skip
        assert top.exit_code == 0, top.output
        (job,) = json.loads(top.stdout)["jobs"]

    alone = subprocess.run(
        [*PLAIT, "train", config, *_settings("alone"), "--set", "telemetry.enabled=false"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stdout + alone.stderr
    torch.testing.assert_close(
        torch.tensor(_losses(tmp_path / "hsdp")), torch.tensor(_losses(tmp_path / "alone")),
        rtol=0, atol=1e-5,
    )  # fmt: skip

    # Across nodes HSDP sends only the replicas' all-reduce of the gradient shards: each of the
    # 4 ranks holds half of the gradient bytes B and sends 2·(2−1)/2 of it, so 2·B per step in
    # all (padding of odd tensors and the loss's few scalars aside). Flat ZeRO-3: 4.5·B.
    B = _gradient_bytes()
    inter = job["comm_bytes_per_step"]["inter_node"]
    assert 2 * B <= inter < 2 * B + B // 50, (inter, B)
