"""Rank functions for the asynchronous checkpoint tests (module level, so spawned ranks can
import them).

The background write is steered through what it calls, never through time: DCP's per-item file
write is wrapped (to hold it, or to fail half-way as a full disk does), and the write's `join`
releases a held write, so a held write finishes exactly when the checkpointer waits for it.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint.filesystem as dcp_filesystem

from plait.core.engine import Engine
from plait.plugins.checkpoint import background, checkpointer, staging
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.plugins.checkpoint.storage import list_checkpoints, temp_dir_name
from tests.dist.checkpoint_workers import engine_batches, engine_config

# A safety net for a broken checkpointer (it never waits for the write it holds): the test then
# fails with this message instead of hanging. Correct code never comes near it.
HOLD_LIMIT_SECONDS = 120.0


class WriteProbe:
    """Holds the writes under an `async/` root until the checkpointer joins them; counts the
    writes in flight whenever a save stages its copy."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.in_flight_at_stage: list[int] = []

    def install(self) -> None:
        real_write = checkpointer.save_state_dict
        real_join = background.BackgroundWrite.join
        real_stage = staging.HostStaging.stage
        probe = self

        def held_write(state: dict[str, Any], directory: Path, **kwargs: Any) -> None:
            if directory.parent.name != "async":  # the synchronous twin writes at once
                real_write(state, directory, **kwargs)
                return
            with probe.lock:
                probe.in_flight += 1
            try:
                if not probe.release.wait(HOLD_LIMIT_SECONDS):
                    raise TimeoutError("the checkpointer never waited for its background write")
                probe.release.clear()
                real_write(state, directory, **kwargs)
            finally:
                with probe.lock:
                    probe.in_flight -= 1

        def releasing_join(self: background.BackgroundWrite) -> None:
            probe.release.set()
            real_join(self)

        def counted_stage(self: staging.HostStaging, state: dict[str, Any]) -> dict[str, Any]:
            with probe.lock:
                probe.in_flight_at_stage.append(probe.in_flight)
                if probe.in_flight:
                    # Fail here, at once: two writes in flight would also deadlock the test.
                    raise AssertionError("a save staged its copy while the previous one wrote")
            return real_stage(self, state)

        checkpointer.save_state_dict = held_write  # type: ignore[assignment]
        background.BackgroundWrite.join = releasing_join  # type: ignore[method-assign]
        staging.HostStaging.stage = counted_stage  # type: ignore[method-assign]


def async_equals_sync(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save steps 3 and 5 both ways; the asynchronous write of step 3 is held while steps 4 and
    5 train (mutating every parameter, optimizer moment, the sampler and the RNG)."""
    del world_size
    probe = WriteProbe()
    probe.install()
    engine = Engine(config=engine_config())
    batches = engine_batches(engine)
    sync = checkpointer.Checkpointer(
        engine, batches, CheckpointIOConfig(dir=f"{root}/sync", async_save=False, keep=0)
    )
    later = checkpointer.Checkpointer(
        engine, batches, CheckpointIOConfig(dir=f"{root}/async", async_save=True, keep=0)
    )
    running_during_training = []
    for step in range(5):
        engine.train_step(batches.next_batch())
        if step + 1 in (3, 5):
            sync.save(step + 1)
            later.save(step + 1)
            assert later._pending is not None
            running_during_training.append(later._pending.running)
    later.close()
    sync.close()
    engine.close()
    return {
        "rank": rank,
        "in_flight_at_stage": probe.in_flight_at_stage,
        "running_during_training": running_during_training,
        "timings": [(t.step, t.asynchronous, t.copy_s, t.write_s) for t in later.timings],
    }


def full_disk_mid_write(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save at 2, 4 and 6 (asynchronously, the default); rank 1's write of step 4 fails half-way
    through its data file with ENOSPC. Returns what the checkpointer reported and when."""
    del world_size
    failing_rank, failing_step = 1, 4
    if rank == failing_rank:
        real = dcp_filesystem._write_item

        def write_item(*args: Any, **kwargs: Any) -> Any:
            stream = args[1]
            if temp_dir_name(failing_step) in str(getattr(stream, "name", "")):
                stream.write(b"\0" * 64)  # some bytes reach the file, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)

        dcp_filesystem._write_item = write_item  # type: ignore[assignment]
    engine = Engine(config=engine_config())
    batches = engine_batches(engine)
    settings = CheckpointIOConfig(dir=root, every=2, keep=0)
    saver = checkpointer.Checkpointer(engine, batches, settings)
    assert saver.config.async_save, "asynchronous saves are the default"
    reported_by_step: dict[int, list[str]] = {}
    on_disk_by_step: dict[int, list[str]] = {}
    losses: dict[int, float] = {}
    for step in range(6):
        losses[step] = engine.train_step(batches.next_batch())
        if (step + 1) % 2 == 0:
            saver.maybe_save(step + 1)
            reported_by_step[step + 1] = [f.describe() for f in saver.failed_saves]
            on_disk_by_step[step + 1] = sorted(p.name for p in Path(root).iterdir())
    saver.close()
    engine.close()
    return {
        "rank": rank,
        "reported_by_step": reported_by_step,
        "on_disk_by_step": on_disk_by_step,
        "published": [p.name for p in list_checkpoints(Path(root))],
        "losses": losses,
    }
