"""Replica-group ranks for healing across inner layouts and for disk checkpoints under fault
tolerance, and the one-process replay they must equal.

Healing: group A (ZeRO-1) trains alone; a group B' with another layout (ZeRO-3) starts once A
stands at `JOIN_STEP`, heals from A and trains beside it.
Checkpoints: groups A and B train; A (the writer while it lives) dies in step `A_DIES`, B goes on
alone and writes the job's checkpoints, then dies in step `B_DIES`; a replacement A', started
when no group is left, resumes from the checkpoint B wrote.
Every ordering the tests rely on is a marker file a rank writes and another waits for.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from plait.core.config import load_config
from plait.core.engine import Engine
from plait.core.state_chunks import layout_for, tensor_pieces
from plait.daemon.lighthouse import read_lighthouse
from plait.plugins.checkpoint import checkpoint_io_config
from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.data import build_batches
from plait.plugins.fault_tolerance import (
    FaultTolerantSteps,
    fault_tolerance_config,
    replica_data_coordinates,
)
from plait.testing.distributed import merged_config
from tests.dist.fault_tolerance_workers import replay_schedule, wait_for, write_marker

HEAL_STEPS = 4
JOIN_STEP = 2  # the first step B' takes part in, healed from A

CHECKPOINT_STEPS = 6
A_DIES = 2  # inside this step; A wrote the checkpoint of the steps before it
B_DIES = 4  # inside this step; B, alone since A_DIES, wrote the checkpoint before it
GROUP_OF = {"A": 0, "B": 1, "B'": 1, "A'": 0}
MARKER_WAIT_SECONDS = 90.0


def job_config(
    *,
    group: int,
    lighthouse: str,
    dp_strategy: str,
    steps: int,
    global_batch_size: int,
    checkpoints: str = "",
) -> dict[str, Any]:
    return merged_config(
        {
            "data": {"seq_len": 16},
            "train": {
                "global_batch_size": global_batch_size,
                "micro_batch_size": None,
                "steps": steps,
                "collective_timeout_seconds": 30.0,
            },
            "parallel": {"dp_strategy": dp_strategy},
            "fault_tolerance": {
                "replica_group": group,
                "replica_groups": 2,
                "lighthouse": lighthouse,
                "step_timeout_seconds": 30.0,
                "quorum_timeout_seconds": 60.0,
            },
            # Groups die inside the step right after a save: the test needs each save on disk
            # when it returns, which an asynchronous save (the default) does not promise.
            "checkpoint_io": {"dir": checkpoints, "every": 2, "keep": 0, "async_save": False},
        }
    )


def _group(config_dict: dict[str, Any]) -> tuple[Any, Engine, Any, FaultTolerantSteps]:
    config = load_config(config_dict)
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
        engine, batches, fault_tolerance_config(config), job_id="ft-heal"
    )
    return config, engine, batches, steps


def _try_record(outcome: Any) -> dict[str, Any]:
    return {
        "step": outcome.step,
        "committed": outcome.committed,
        "participants": outcome.participants,
        "events": [(e.kind, e.step, e.participants, e.previous) for e in outcome.events],
        "event_seconds": [(e.kind, e.seconds) for e in outcome.events],
    }


def held_weights(engine: Engine) -> dict[str, Any]:
    """What this rank holds of every parameter's fp32 value, by global name: the global shape
    and `(offsets, values)` chunks, whatever the layout (the test puts them together)."""
    held = {}
    for name, entry in layout_for(engine).by_name().items():
        pieces = tensor_pieces(entry.value)
        held[name] = (
            tuple(pieces.global_shape),
            [(tuple(c.offsets), c.tensor.detach().clone()) for c in pieces.chunks],
        )
    return held


def _wait_until_asked(lighthouse: str, waiting: int, what: str) -> None:
    deadline = time.monotonic() + MARKER_WAIT_SECONDS
    while read_lighthouse(lighthouse).waiting < waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never asked for a quorum")
        time.sleep(0.02)


def layout_group_rank(
    rank: int, world_size: int, role: str, lighthouse: str, markers: str, dp_strategy: str
) -> dict[str, Any]:
    """One rank of A (alone until B' joins) or of B' (heals from A at `JOIN_STEP`)."""
    marker_dir = Path(markers)
    _, engine, _, steps = _group(
        job_config(
            group=GROUP_OF[role],
            lighthouse=lighthouse,
            dp_strategy=dp_strategy,
            steps=HEAL_STEPS,
            global_batch_size=8,
        )
    )
    write_marker(marker_dir / f"manager-{role}-{rank}", steps.replica_id)
    tries = []
    waited = role != "A"
    while engine.global_step < HEAL_STEPS:
        if not waited and engine.global_step == JOIN_STEP:
            if rank == 0:
                write_marker(marker_dir / "A-at-join", str(JOIN_STEP))
            for peer in range(world_size):
                wait_for(marker_dir / f"manager-B'-{peer}", "group B' to start")
            # B' asks first: the lighthouse then forms the quorum with both groups at once.
            _wait_until_asked(lighthouse, 1, "group B'")
            waited = True
        started = time.perf_counter()
        tries.append(_try_record(steps.step()) | {"seconds": time.perf_counter() - started})
    weights = held_weights(engine)
    steps.close()
    engine.close()
    return {"tries": tries, "weights": weights}


def _fail_in_forward(engine: Engine, marker: Path) -> None:
    def fail(*_: Any) -> None:
        write_marker(marker, str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)

    engine.module.register_forward_pre_hook(fail)


def checkpoint_group_rank(
    rank: int, world_size: int, role: str, lighthouse: str, markers: str, checkpoints: str
) -> dict[str, Any]:
    """One rank of A, B or the replacement A': the training loop of `plait train` (resume from
    the job's checkpoint, then steps; the group `writes_checkpoints` saves)."""
    marker_dir = Path(markers)
    config, engine, batches, steps = _group(
        job_config(
            group=GROUP_OF[role],
            lighthouse=lighthouse,
            dp_strategy="ddp",
            steps=CHECKPOINT_STEPS,
            global_batch_size=4,
            checkpoints=checkpoints,
        )
    )
    checkpointer = Checkpointer(engine, batches, checkpoint_io_config(config))
    start = checkpointer.maybe_resume()
    steps.resume_from(start)
    write_marker(marker_dir / f"manager-{role}-{rank}", steps.replica_id)
    if role in ("A", "B"):
        # Both groups take step 0: each waits until the lighthouse hears both.
        for group in ("A", "B"):
            for peer in range(world_size):
                wait_for(marker_dir / f"manager-{group}-{peer}", f"group {group} to start")
        groups = {(marker_dir / f"manager-{g}-0").read_text() for g in ("A", "B")}
        deadline = time.monotonic() + MARKER_WAIT_SECONDS
        while not groups <= set(read_lighthouse(lighthouse).heartbeats):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lighthouse never heard all of {groups}")
            time.sleep(0.02)
    dies = {"A": A_DIES, "B": B_DIES}.get(role)
    tries, written = [], []
    while engine.global_step < CHECKPOINT_STEPS:
        if engine.global_step == dies and rank == world_size - 1:
            _fail_in_forward(engine, marker_dir / f"{role}-failed")
        outcome = steps.step_until_committed()
        tries.append(_try_record(outcome))
        if steps.writes_checkpoints and checkpointer.maybe_save(outcome.step + 1):
            written.append(outcome.step + 1)
            write_marker(marker_dir / f"wrote-{role}-{rank}-{outcome.step + 1}", "")
    checkpointer.close()
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    steps.close()
    engine.close()
    return {"start": start, "tries": tries, "written": written, "weights": weights}


def replay(
    rank: int,
    world_size: int,
    ranks: int,
    schedule: tuple[tuple[int, ...], ...],
    global_batch_size: int,
) -> dict[str, torch.Tensor]:
    """`schedule` replayed in one process (`fault_tolerance_workers.replay_schedule`)."""
    del rank, world_size
    config = job_config(
        group=0,
        lighthouse="127.0.0.1:1",
        dp_strategy="ddp",
        steps=len(schedule),
        global_batch_size=global_batch_size,
    )
    return replay_schedule(config, ranks, schedule)
