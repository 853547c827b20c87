"""Profiling on demand: what the control channel costs a step, and what a capture costs.

    python tools/bench/profiling.py [--steps 60] [--block 2] [--capture-steps 2] [--poll-ms 500]

Two Gloo ranks each build one engine over a tiny Llama exporting to a daemon in this process.

1. Step time outside a capture. Each rank rotates blocks of steps between four modes on ONE
   engine (two engines differ by a few percent from memory layout alone): telemetry off (its
   plugin unregistered, the exporter's control tick stopped), telemetry without the control
   channel, profiling-capable (telemetry with the channel polling every `--poll-ms`), and off
   again (the noise floor). Reported: median `train_step` wall time per mode and the median
   over rounds of each round's ratio to "off", so machine noise hits every mode alike.
2. A capture. The ranks then keep stepping, profiling-capable, while this process asks the
   daemon for a `--capture-steps` capture (prepare, then collect) and records its wall time.
   Reported: the captured steps' time against the median step outside any capture (a captured
   step pays for recording every operator, the first for starting the profiler, the last for
   stopping it and building its events), the steps taken while the profilers were prepared
   (the first in a process initialises Kineto, off the training thread), and the step after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from rich.console import Console
from rich.table import Table

from plait.core.plugins import Plugins
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc
from plait.testing.distributed import run_distributed

VOCAB_SEQ = 16
JOB = "bench-profile"
MODES = ("off", "telemetry", "capable", "control")  # control: off again (A/A: the noise floor)


def _engine(address: str) -> Any:
    from plait.core.engine import Engine

    torch.manual_seed(0)
    return Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": VOCAB_SEQ},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "seed": 0},
            "ddp": {"bucket_mb": 0.05},
            "telemetry": {"enabled": True, "daemon": address, "job_id": JOB},
        },
        plugins=Plugins.create(autoload=False),
    )


def bench_rank(
    rank: int, world_size: int, address: str, steps: int, block: int, control_dir: str
) -> dict[str, Any]:
    engine = _engine(address)
    manager = engine.plugins.manager
    plugin = manager.get_plugin("telemetry")
    assert plugin.telemetry is not None, "the daemon was not reached"
    exporter, control = plugin.telemetry.spans, plugin.telemetry.control
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(rank)

    def use(mode: str) -> None:
        registered = manager.has_plugin("telemetry")
        if mode in ("telemetry", "capable") and not registered:
            manager.register(plugin, name="telemetry")
        elif mode in ("off", "control") and registered:
            manager.unregister(name="telemetry")
        exporter.on_tick = control.tick if mode == "capable" else None

    def step() -> float:
        tokens = torch.randint(0, vocab, (4, VOCAB_SEQ + 1), generator=generator)
        start = time.perf_counter()
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        return time.perf_counter() - start

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up outside the measurement
        use(mode)
        for _ in range(2):
            step()
    for i in range(steps // block):
        order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
        for mode in order:
            use(mode)
            for _ in range(block):
                times[mode].append(step())
    # Phase 2: profiling-capable until told to stop; every step's number and time kept.
    use("capable")
    stop = Path(control_dir) / "stop"
    flag = torch.zeros(1)
    capture: list[tuple[int, float]] = []
    while True:
        number = engine.global_step
        capture.append((number, step()))
        flag.fill_(float(stop.exists()))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            break
    engine.close()
    return {"times": times, "capture": capture, "phase2_first": capture[0][0]}


def ratios(times: dict[str, list[float]], mode: str) -> list[float]:
    return [a / b for a, b in zip(times[mode], times["off"], strict=True)]


def ask_for_a_capture(address: str, steps: int, phase2_first: int) -> dict[str, Any]:
    """Wait for the ranks to reach phase 2, then prepare and collect a capture."""
    channel = grpc.insecure_channel(address)
    stub = control_pb2_grpc.ControlStub(channel)
    deadline = time.monotonic() + 600
    while True:
        listed = stub.ListEndpoints(control_pb2.ListEndpointsRequest(job_id=JOB)).endpoints
        if len(listed) == 2 and min(e.step for e in listed) >= phase2_first + 10:
            break
        if time.monotonic() > deadline:
            raise SystemExit("the ranks never reached the capture phase")
        time.sleep(0.2)
    asked_at = min(e.step for e in listed)
    began = time.perf_counter()
    prepared = stub.PrepareProfile(control_pb2.ProfileRequest(job_id=JOB, steps=steps))
    prepare_seconds = time.perf_counter() - began
    ready_at = max(e.step for e in prepared.endpoints)
    began = time.perf_counter()
    collected = stub.CollectProfile(
        control_pb2.CollectProfileRequest(request_id=prepared.request_id)
    )
    collect_seconds = time.perf_counter() - began
    channel.close()
    return {
        "asked_at": asked_at,
        "ready_at": ready_at,
        "start": collected.start_step,
        "steps": collected.steps,
        "prepare_seconds": prepare_seconds,
        "collect_seconds": collect_seconds,
        "trace_bytes": collected.trace_bytes,
        "outcomes": [(o.rank, o.state) for o in collected.outcomes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per mode")
    parser.add_argument("--block", type=int, default=2, help="steps per alternating block")
    parser.add_argument("--capture-steps", type=int, default=2)
    parser.add_argument("--poll-ms", type=int, default=500, help="the ranks' poll interval")
    args = parser.parse_args()
    os.environ["PLAIT_CONTROL_POLL_MS"] = str(args.poll_ms)
    console = Console()
    phase2_first = 8 + 4 * args.steps  # warm-up steps plus every mode's measured ones
    with (
        DaemonServer("127.0.0.1:0", host_interval=1.0) as server,
        tempfile.TemporaryDirectory() as control_dir,
    ):
        import threading

        outcome: dict[str, Any] = {}

        def capture() -> None:
            try:
                outcome.update(ask_for_a_capture(server.address, args.capture_steps, phase2_first))
            finally:
                (Path(control_dir) / "stop").touch()

        asker = threading.Thread(target=capture)
        asker.start()
        per_rank = run_distributed(
            bench_rank, 2, server.address, args.steps, args.block, control_dir, timeout=1800
        )
        asker.join()

    table = Table(
        title=f"step time outside a capture, 2 Gloo ranks, tiny Llama, blocks of {args.block}"
    )
    for column in ("rank", *(f"median {m}" for m in MODES), "telemetry / off", "capable / off",
                   "control / off", "rounds"):  # fmt: skip
        table.add_column(column, justify="right")
    capable, controls, telemetry = [], [], []
    for rank, result in enumerate(per_rank):
        times = result["times"]
        median = {mode: statistics.median(values) for mode, values in times.items()}
        telemetry.append(statistics.median(ratios(times, "telemetry")))
        capable.append(statistics.median(ratios(times, "capable")))
        controls.append(statistics.median(ratios(times, "control")))
        table.add_row(
            str(rank), *(f"{median[m] * 1e3:.2f} ms" for m in MODES),
            f"{telemetry[-1]:.4f}", f"{capable[-1]:.4f}", f"{controls[-1]:.4f}",
            str(len(times["off"])),
        )  # fmt: skip
    console.print(table)
    console.print(
        f"profiling-capable vs telemetry off: {(statistics.mean(capable) - 1) * 100:+.2f} %; "
        f"telemetry without the channel: {(statistics.mean(telemetry) - 1) * 100:+.2f} %; "
        f"off/off again, the noise floor: {(statistics.mean(controls) - 1) * 100:+.2f} % "
        f"(poll every {args.poll_ms} ms)"
    )

    start, steps = outcome["start"], outcome["steps"]
    captured_steps = set(range(start, start + steps))
    prepared_steps = set(range(outcome["asked_at"], outcome["ready_at"] + 1))
    table = Table(title=f"a {steps}-step capture (steps {start}–{start + steps - 1})")
    for column in ("rank", "median outside", "captured steps", "captured / outside",
                   "steps while preparing / outside", "step after / outside",
                   "extra ms"):  # fmt: skip
        table.add_column(column, justify="right")
    for rank, result in enumerate(per_rank):
        by_step = dict(result["capture"])
        outside = statistics.median(
            t for s, t in by_step.items() if s not in captured_steps | prepared_steps
            and s != start + steps
        )  # fmt: skip
        captured = [by_step[s] for s in sorted(captured_steps)]
        preparing = [by_step[s] for s in sorted(prepared_steps) if s in by_step]
        after = by_step.get(start + steps, float("nan"))
        # What the capture cost this rank's training thread in all: its steps and the next.
        extra = sum(captured) + after - (len(captured) + 1) * outside
        table.add_row(
            str(rank), f"{outside * 1e3:.2f} ms",
            ", ".join(f"{t * 1e3:.1f} ms" for t in captured),
            f"{statistics.mean(captured) / outside:.2f}",
            f"{statistics.median(preparing) / outside:.2f}" if preparing else "-",
            f"{after / outside:.2f}", f"{extra * 1e3:.0f}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"prepare call {outcome['prepare_seconds']:.2f} s (first profiler in each process), "
        f"collect call {outcome['collect_seconds']:.2f} s, merged trace "
        f"{outcome['trace_bytes'] / 2**20:.1f} MiB; outcomes {outcome['outcomes']}"
    )


if __name__ == "__main__":
    main()
