"""Replica-group ranks for the fault-tolerance tests, and the one-process replay they must equal.

Group A trains the whole run; group B's last rank SIGKILLs (or SIGSTOPs) itself inside the
forward of step `KILL_STEP`; a replacement B' is started once A stands at step `REJOIN_STEP` and
heals from A.
Every ordering the test relies on is a marker file a rank writes and another waits for.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from plait.core.config import load_config
from plait.core.engine import Engine
from plait.daemon.lighthouse import read_lighthouse
from plait.plugins.data import build_batches
from plait.plugins.fault_tolerance import (
    FaultTolerantSteps,
    fault_tolerance_config,
    replica_data_coordinates,
)
from plait.plugins.fault_tolerance.quorum_events import publish_quorum_events
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.testing.distributed import merged_config

STEPS = 6
KILL_STEP = 2  # k: B dies inside it; A retries it alone
REJOIN_STEP = 4  # j + 1: the first step B' takes part in, healed from A
GROUP_OF = {"A": 0, "B": 1, "B'": 1}
JOB_ID = "ft-job"
MARKER_WAIT_SECONDS = 90.0


def job_config(*, group: int, lighthouse: str, layout: dict[str, Any]) -> dict[str, Any]:
    return merged_config(
        {
            "data": {"seq_len": 16},
            "train": {
                "global_batch_size": layout.get("global_batch_size", 4),
                "micro_batch_size": None,
                "steps": STEPS,
                "collective_timeout_seconds": 30.0,
            },
            "parallel": {"dp_strategy": layout.get("dp_strategy", "ddp")},
            # The ranks report to the daemon that hosts the lighthouse (`plait status`).
            "telemetry": {
                "enabled": "daemon" in layout,
                "daemon": layout.get("daemon", ""),
                "job_id": JOB_ID,
            },
            "fault_tolerance": {
                "replica_group": group,
                "replica_groups": 2,
                "lighthouse": lighthouse,
                # A hung peer is left out after this long (the SIGSTOP case).
                "step_timeout_seconds": layout.get("step_timeout_seconds", 30.0),
                "quorum_timeout_seconds": 60.0,
            },
        }
    )


def write_marker(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a reader that sees it exist reads all of `text`."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def wait_for(path: Path, what: str, *, unless: Any = None) -> None:
    """Block until another process wrote `path` (the ordering event), or fail naming it; with
    `unless` (a thread), fail at once with its error if it ends first."""
    deadline = time.monotonic() + MARKER_WAIT_SECONDS
    while not path.exists():
        if unless is not None and not unless.is_alive():
            raise AssertionError(f"{what}: it ended without writing {path}: {unless.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} never appeared")
        time.sleep(0.02)


def wait_until_listed(daemon: str, group: int, rank: int) -> None:
    """Until the daemon lists this rank of `group`: a group that dies in its first steps was
    seen alive, so `plait status` can show it leave."""
    with grpc.insecure_channel(daemon) as channel:
        stub = daemon_pb2_grpc.DaemonStub(channel)
        request = daemon_pb2.ListRanksRequest(job_id=JOB_ID)
        deadline = time.monotonic() + MARKER_WAIT_SECONDS
        while (group, rank) not in {
            (r.replica_group, r.rank) for r in stub.ListRanks(request, timeout=10).ranks
        }:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon never listed rank {rank} of group {group}")
            time.sleep(0.02)


def _fail_in_forward(module: torch.nn.Module, marker: Path, fault: str) -> None:
    """SIGKILL (a death) or SIGSTOP (a hang: the process stops answering, heartbeats included)
    this process inside its next forward, after writing its PID to `marker`."""

    def fail(*_: Any) -> None:
        write_marker(marker, str(os.getpid()))
        os.kill(os.getpid(), signal.Signals[fault])

    module.register_forward_pre_hook(fail)


def replica_group_rank(
    rank: int, world_size: int, role: str, lighthouse: str, markers: str, layout: dict[str, Any]
) -> dict[str, Any]:
    """One rank of group `role`; returns its PIDs, every try of every step and final weights."""
    marker_dir = Path(markers)
    pid_at_start = os.getpid()
    os.environ["PLAIT_HEARTBEAT_INTERVAL_MS"] = "200"  # heard by the daemon soon after start
    config = load_config(job_config(group=GROUP_OF[role], lighthouse=lighthouse, layout=layout))
    engine = Engine(config=config)
    dp_rank, dp_size = replica_data_coordinates(
        dp_rank=engine.mesh.coordinate("dp"),
        dp_size=engine.mesh.size("dp"),
        settings=fault_tolerance_config(config),
    )
    batches = build_batches(
        config.data,
        seq_len=config.data.seq_len,
        global_batch_size=config.train.global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.train.seed,
    )
    steps = FaultTolerantSteps.attach(
        engine, batches, fault_tolerance_config(config), job_id=JOB_ID
    )
    if "daemon" in layout:
        wait_until_listed(layout["daemon"], GROUP_OF[role], rank)
    write_marker(marker_dir / f"manager-{role}-{rank}", steps.replica_id)
    if role in ("A", "B"):
        # Both groups' managers heartbeat before either asks for the first quorum: step 0 is
        # taken by both, whatever the order the processes started in.
        for group in ("A", "B"):
            for peer in range(world_size):
                wait_for(marker_dir / f"manager-{group}-{peer}", f"group {group} to start")
        # With no quorum before it, the first one waits for every group the lighthouse hears.
        groups = {(marker_dir / f"manager-{g}-0").read_text() for g in ("A", "B")}
        deadline = time.monotonic() + MARKER_WAIT_SECONDS
        while not groups <= set(read_lighthouse(lighthouse).heartbeats):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lighthouse never heard all of {groups}")
            time.sleep(0.02)
    tries: list[dict[str, Any]] = []
    while engine.global_step < STEPS:
        step = engine.global_step
        if role == "B" and step == KILL_STEP and rank == world_size - 1:
            _fail_in_forward(engine.module, marker_dir / "B-failed", layout.get("fault", "SIGKILL"))
        if role == "A" and step == REJOIN_STEP and not (marker_dir / "A-at-rejoin").exists():
            if rank == 0:
                write_marker(marker_dir / "A-at-rejoin", str(step))
            for peer in range(world_size):
                wait_for(marker_dir / f"manager-B'-{peer}", "the replacement group to start")
            # B' must have asked for the quorum before A does: the lighthouse forms a quorum at
            # once when every member of the last one asks (torchft's fast quorum), without
            # waiting for a group that only heartbeats.
            deadline = time.monotonic() + MARKER_WAIT_SECONDS
            while read_lighthouse(lighthouse).waiting < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the replacement group never asked for a quorum")
                time.sleep(0.02)
        outcome = steps.step()
        if rank == 0:  # as the trainer does: the group's leader reports its quorum events
            publish_quorum_events(outcome.events, replica_id=steps.replica_id)
        tries.append(
            {
                "step": outcome.step,
                "committed": outcome.committed,
                "participants": outcome.participants,
                "quorum_id": outcome.quorum_id,
                "loss": outcome.loss,
                "events": [(e.kind, e.step, e.participants, e.previous) for e in outcome.events],
                "event_seconds": [(e.kind, e.seconds) for e in outcome.events],
            }
        )
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    steps.close()
    engine.close()
    return {
        "pid_at_start": pid_at_start,
        "pid_at_end": os.getpid(),
        "tries": tries,
        "weights": weights,
    }


def participants_of(step: int) -> tuple[int, ...]:
    """The groups whose gradients step `step` averages, in the schedule the test drives."""
    return (0,) if KILL_STEP <= step < REJOIN_STEP else (0, 1)


def replay(
    rank: int, world_size: int, ranks: int, layout: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The test's schedule (`participants_of`) replayed in one process (`replay_schedule`)."""
    del rank, world_size
    # One process holds every parameter whole: a plain optimizer over them, whatever the groups'
    # inner layout.
    single = {**layout, "dp_strategy": "ddp"}
    config = job_config(group=0, lighthouse="127.0.0.1:1", layout=single)
    return replay_schedule(config, ranks, tuple(participants_of(s) for s in range(STEPS)))


def replay_schedule(
    config_dict: dict[str, Any], ranks: int, schedule: tuple[tuple[int, ...], ...]
) -> dict[str, torch.Tensor]:
    """`schedule[s]` lists the groups whose gradients step s averages; one process replays it:
    each group's gradient the mean of its `ranks` ranks' (one addition, then the division),
    each step the mean of the participating groups' gradients the same way, as the group's
    reduction and the quorum's all-reduce compute them. Returns the weights at the end."""
    config = load_config(config_dict, ["fault_tolerance.replica_group=-1"])
    engine = Engine(config=config)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    rank_batches = [
        build_batches(
            config.data,
            seq_len=config.data.seq_len,
            global_batch_size=config.train.global_batch_size,
            dp_rank=data_rank,
            dp_size=2 * ranks,
            seed=config.train.seed,
        )
        for data_rank in range(2 * ranks)
    ]

    def mean(tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if len(tensors) == 1 else (tensors[0] + tensors[1]) / len(tensors)

    for step, groups in enumerate(schedule):
        group_grads: list[list[torch.Tensor]] = []
        for group in groups:
            rank_grads: list[list[torch.Tensor]] = []
            for group_rank in range(ranks):
                inputs, targets = rank_batches[group * ranks + group_rank].batch_at(step)
                engine.optimizer.zero_grad(set_to_none=True)
                engine.loss_fn(engine.module(inputs), targets).backward()
                rank_grads.append([p.grad.detach().clone() for p in params])
            group_grads.append([mean(list(g)) for g in zip(*rank_grads, strict=True)])
        for param, grads in zip(params, zip(*group_grads, strict=True), strict=True):
            param.grad = mean(list(grads))
        engine.optimizer_step()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
