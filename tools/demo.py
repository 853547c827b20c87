"""`plait demo` (and `make demo`): a node daemon plus a short multi-rank CPU training run.

The daemon runs in this process on a free loopback port; the ranks are launched by `plait train`
(torchrun) with `PLAIT_DAEMON` pointing at it. While they train, the demo prints what the daemon
computes from the ranks' OpenTelemetry export — live MFU per rank — and at the end the operator
view (`plait top --once`) and the bottleneck report (`plait bottleneck`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from rich.console import Console

from plait.daemon.mfu import format_mfu
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.tools.starter_configs import starter_path
from plait.training.output import heading, make_console

DEMO_CONFIG = "demo"  # the example config (`plait.tools.starter_configs`) the demo trains
POLL_SECONDS = 4.0


def _live_line(stub: daemon_pb2_grpc.DaemonStub) -> str | None:
    response = stub.GetMetrics(daemon_pb2.GetMetricsRequest(window_steps=5), timeout=2.0)
    if not response.ranks:
        return None
    ranks = sorted(response.ranks, key=lambda r: r.rank)
    parts = [
        f"rank {r.rank}: step {r.step} · {r.tokens_per_second:,.0f} tok/s · MFU {format_mfu(r.mfu)}"
        for r in ranks
    ]
    return "daemon │ " + " | ".join(parts)


def _watch(stub: daemon_pb2_grpc.DaemonStub, done: threading.Event, console: Console) -> None:
    while not done.wait(POLL_SECONDS):
        try:
            line = _live_line(stub)
        except grpc.RpcError:
            continue
        if line:
            console.print(line, style="cyan", highlight=False)


def run_demo(*, nproc_per_node: int = 2, steps: int = 40, config: Path | None = None) -> int:
    """Run the demo on `config` (default: the `demo` example that ships with plait)."""
    if config is None:
        with starter_path(DEMO_CONFIG) as shipped:
            return _run(nproc_per_node=nproc_per_node, steps=steps, config=shipped)
    return _run(nproc_per_node=nproc_per_node, steps=steps, config=config)


def _run(*, nproc_per_node: int, steps: int, config: Path) -> int:
    console = make_console()
    server = DaemonServer("127.0.0.1:0").start()
    console.print(f"[bold]plait demo[/bold]: node daemon on {server.address}", highlight=False)
    channel = grpc.insecure_channel(server.address)
    stub = daemon_pb2_grpc.DaemonStub(channel)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(stub, done, console), daemon=True)
    env = dict(os.environ, PLAIT_DAEMON=server.address)
    command = [
        sys.executable, "-m", "plait.tools.cli", "train", str(config),
        "--nproc-per-node", str(nproc_per_node), "--set", f"train.steps={steps}",
    ]  # fmt: skip
    try:
        watcher.start()
        code = subprocess.run(command, env=env, check=False).returncode
        done.set()
        watcher.join()
        if code != 0:
            console.print(f"[red]training exited with code {code}[/red]")
            return code
        _final_report(server.address, console)
        return 0
    finally:
        done.set()
        channel.close()
        server.stop(grace=1.0)


def _final_report(address: str, console: Console) -> None:
    from plait.tools import daemon_commands

    heading(console, "what the daemon saw")
    with grpc.insecure_channel(address) as channel:
        stub = daemon_pb2_grpc.DaemonStub(channel)
        # The demo's job has finished by now: ask for finished jobs too.
        request = daemon_pb2.GetMetricsRequest(include_finished=True)
        metrics = stub.GetMetrics(request, timeout=5.0)
        console.print(daemon_commands.render_top({address: metrics}, console.width))
    heading(console, "bottleneck report")
    daemon_commands.bottleneck(
        hosts=[address], job="", window_steps=20, threshold=0.2, png=None, show_all=True
    )
