"""The training loop's checkpoint policy: resume at start, save every N steps, keep the last K.

    checkpointer = Checkpointer.from_config(engine, batches, config)
    start = checkpointer.maybe_resume()           # 0, or the step of the latest good checkpoint
    for step in range(start, config.train.steps):
        engine.train_step(batches.next_batch())
        checkpointer.maybe_save(step + 1)
    checkpointer.close()                          # waits for an asynchronous save

Configured by the `[checkpoint_io]` section (`[checkpoint]` is activation checkpointing). The
section's NaN/Inf guard and fault injection are not the checkpointer's: the training loop
attaches them beside it (`plait.plugins.resilience.attach_resilience`).
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.core.comm import Group
from plait.core.config import CheckpointIOSection as CheckpointIOConfig
from plait.core.config import PlaitConfig
from plait.plugins.checkpoint.state import (
    LoadReport,
    engine_state_dict,
    load_engine_state,
    save_state_dict,
)
from plait.plugins.checkpoint.storage import (
    CheckpointError,
    describe_files,
    find_latest_complete,
    publish,
    resolve_checkpoint,
    temp_dir_name,
    verify,
    write_manifest,
)

log = logging.getLogger(__name__)
SECTION = "checkpoint_io"


def checkpoint_io_config(config: PlaitConfig) -> CheckpointIOConfig:
    """The `[checkpoint_io]` section of a job's config."""
    return config.checkpoint_io


class Checkpointer:
    """Saves and resumes one engine (and its sampler) under `config.dir`."""

    def __init__(self, engine: Any, batches: Any, config: CheckpointIOConfig) -> None:
        self.engine = engine
        self.batches = batches
        self.config = config
        self.root = Path(config.dir).expanduser() if config.dir else None
        self.total_steps = engine.config.train.steps
        self.rank = engine.mesh.rank
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self.last_saved_step: int | None = None
        # DCP coordinates over a process group of its own: a dedicated Gloo group keeps checkpoint
        # traffic out of the training groups' op sequence and lets a save thread run beside
        # training. Creating a group is collective, so it is made here, on every rank.
        # Held weakly (a `Group`), so destroying the process groups at exit frees it.
        distributed = self.root is not None and dist.get_world_size() > 1
        self._group = (
            Group(
                name="checkpoint",
                ranks=tuple(range(dist.get_world_size())),
                process_group=dist.new_group(backend="gloo"),
            )
            if distributed
            else None
        )

    @property
    def group(self) -> Any:
        """The checkpoint's own Gloo process group (None in one process or without a dir)."""
        return self._group.process_group if self._group is not None else None

    @classmethod
    def from_config(cls, engine: Any, batches: Any, config: PlaitConfig) -> Checkpointer:
        return cls(engine, batches, checkpoint_io_config(config))

    # -- resume -----------------------------------------------------------------------------------

    def maybe_resume(self) -> int:
        """Load the latest complete checkpoint (or `init_from` weights); return the next step."""
        if self.root is not None and self.config.resume:
            path = self._agree_on(self._find_resumable)
            if path is not None:
                report = self.load(Path(path))
                log.warning("resumed from %s at step %d", path, report.step)
                return report.step
        if self.config.init_from:
            self.load(resolve_checkpoint(Path(self.config.init_from)), model_only=True)
        return int(self.engine.global_step)

    def _find_resumable(self) -> str | None:
        assert self.root is not None
        path, rejected = find_latest_complete(self.root, checksums=self.config.verify_checksums)
        for verdict in rejected:
            print(
                f"plait: checkpoint {verdict.path} is unusable ({verdict.problem}); "
                "trying the previous one",
                flush=True,
            )
        return str(path) if path is not None else None

    def load(self, path: Path, *, model_only: bool = False) -> LoadReport:
        """Load one checkpoint directory into the engine (resharding as needed)."""
        if not model_only:
            verdict = verify(path, checksums=self.config.verify_checksums)
            if not verdict.ok:
                raise CheckpointError(f"checkpoint {path} is unusable: {verdict.problem}")
        return load_engine_state(
            self.engine,
            path,
            batches=None if model_only else self.batches,
            process_group=self.group,
            model_only=model_only,
        )

    def _agree_on(self, choose: Any) -> Any:
        """Rank 0 decides (e.g. which checkpoint verifies); every rank gets its answer."""
        value = [choose() if self.rank == 0 else None]
        if self.group is not None:
            dist.broadcast_object_list(value, src=0, group=self.group)
        return value[0]

    # -- save -------------------------------------------------------------------------------------

    def maybe_save(self, steps_done: int) -> bool:
        """Save if `steps_done` is a multiple of `every`, or the last step; True if it saved."""
        if self.root is None:
            return False
        periodic = self.config.every > 0 and steps_done % self.config.every == 0
        final = self.config.save_final and steps_done == self.total_steps
        if not (periodic or final) or steps_done == self.last_saved_step:
            return False
        self.save(steps_done)
        return True

    def save(self, step: int) -> None:
        """Write a checkpoint of the current state as `step-N` (in the background if async)."""
        if self.root is None:
            raise CheckpointError("checkpoint_io.dir is not set")
        self.wait()
        temp = self.root / temp_dir_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if temp.exists():
                shutil.rmtree(temp)  # left by a crash during an earlier attempt at this step
        self._barrier()
        state = engine_state_dict(
            self.engine, batches=self.batches, stage_to_cpu=self.config.async_save
        )
        self.last_saved_step = step
        if not self.config.async_save:
            self._write(state, temp, step)
            return
        self._pending = threading.Thread(
            target=self._write_in_background, args=(state, temp, step), daemon=True
        )
        self._pending.start()

    def _write_in_background(self, state: dict[str, Any], temp: Path, step: int) -> None:
        try:
            self._write(state, temp, step)
        except BaseException as exc:  # reported by the next wait()
            self._pending_error = exc

    def _write(self, state: dict[str, Any], temp: Path, step: int) -> None:
        assert self.root is not None
        save_state_dict(state, temp, process_group=self.group)
        # Each rank checksums the data files it wrote; rank 0 adds DCP's index and publishes.
        own = sorted(p.name for p in temp.glob(f"__{self.rank}_*.distcp"))
        parts: list[Any] = [None] * dist.get_world_size()
        files = describe_files(temp, own)
        if self.group is not None:
            dist.all_gather_object(parts, files, group=self.group)
        else:
            parts = [files]
        if self.rank == 0:
            merged: dict[str, dict[str, int]] = {}
            for part in parts:
                merged.update(part)
            merged.update(describe_files(temp, [".metadata"]))
            write_manifest(temp, merged, step)
            publish(self.root, temp, step, keep=self.config.keep)
        self._barrier()

    def wait(self) -> None:
        """Block until an asynchronous save has been published; re-raise its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise CheckpointError(f"asynchronous checkpoint save failed: {error}") from error

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        self.wait()
